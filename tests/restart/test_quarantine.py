"""Quarantine on real ranks: each rank names its own host (TRAINGUARD_HOST_NAME), so that one
machine holds four "hosts"; faults are real exceptions and a real NaN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests.restart import _quarantine_jobs as jobs
from trainguard import events, report


def _hosts(r: int) -> dict[str, str]:
    return {"TRAINGUARD_HOST_NAME": f"h{r}"}


def _events(directory: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events.read_events(directory) if e["kind"] == kind]


@pytest.mark.parametrize("how", ["raise", "nan", "hang", "leave"])
def test_a_flaky_host_is_quarantined_after_two_faults_and_the_job_finishes_full(
    tmp_path: Path, how: str
) -> None:
    qfile = tmp_path / "exclude"
    results = run_ranks(
        jobs.flaky_host,
        4,
        args=(str(qfile), how),
        timeout=120,
        env={"TRAINGUARD_EVENTS_DIR": str(tmp_path)},
        rank_env=_hosts,
    )
    out = [r.get() for r in results]
    # round 0 and 1 failed on h1; round 2 ran without it, at full active size (3)
    assert out[1] == {"value": None, "rounds": [0, 1]}  # never active again: no more faults
    for r in (0, 2, 3):
        assert out[r]["value"]["round"] == 2, out
        assert out[r]["value"]["sum"] == 3, out  # the collective had 3 ranks
    assert out[3]["rounds"] == [2]  # the spare took h1's place
    assert out[3]["value"]["rank"] == 1  # FillGaps: the spare got rank 1's number
    assert qfile.read_text() == "h1\n"
    blamed = _events(tmp_path, "fault_attributed")
    kind = {"raise": "OSError", "nan": "NonFiniteError", "hang": "Hang", "leave": "OSError"}[how]
    assert [(e["fault_host"], e["fault_kind"], e["counted"]) for e in blamed] == [
        ("h1", kind, True),
        ("h1", kind, True),
    ]
    if how != "hang":  # an exception's place; a hang is a cause of its own
        assert all("_quarantine_jobs.py:" in e["cause"] for e in blamed), blamed
    (taken,) = _events(tmp_path, "host_quarantined")
    assert taken["quarantined_host"] == "h1" and "2 faults within 3600 s" in taken["why"]
    table = report.format_table(report.load(tmp_path))  # trainguard report's text
    assert "faults by host: 1 host" in table, table
    assert f"h1: 2 faults (2 counted): 2 x {kind}" in table, table
    assert "; quarantined: 2 faults within 3600 s" in table, table


def test_the_same_error_at_the_same_place_on_every_host_is_blamed_on_none(
    tmp_path: Path,
) -> None:
    qfile = tmp_path / "exclude"
    results = run_ranks(
        jobs.software_bug,
        3,
        args=(str(qfile),),
        timeout=120,
        env={"TRAINGUARD_EVENTS_DIR": str(tmp_path)},
        rank_env=_hosts,
    )
    for res in (r.get() for r in results):
        # today's repeat detection ends it, not a quarantine
        assert res["type"] == "RetryLimitError", res
        assert "3 rounds in a row failed with the same error" in res["error"]
        assert res["rounds"] == [0, 1, 2]
    assert _events(tmp_path, "host_quarantined") == []
    assert not qfile.exists() or qfile.read_text() == ""
    blamed = _events(tmp_path, "fault_attributed")
    assert len(blamed) == 3  # rounds 0, 1 and 2 (reported on entering the next)
    assert not any(e["counted"] for e in blamed[1:]), blamed  # seen on another host by then
    table = report.format_table(report.load(tmp_path))
    assert "counted against no host (the same cause on several hosts)" in table, table


def test_a_host_is_kept_out_while_its_probe_fails_and_readmitted_as_a_spare(
    tmp_path: Path,
) -> None:
    qfile, marker = tmp_path / "exclude", tmp_path / "marker"
    marker.write_text("sick\n")
    results = run_ranks(
        jobs.readmitted,
        4,
        args=(str(qfile), str(marker)),
        timeout=120,
        env={"TRAINGUARD_EVENTS_DIR": str(tmp_path)},
        rank_env=_hosts,
    )
    out = [r.get() for r in results]
    assert out[1] == {"value": None, "rounds": [0, 1]}  # out in rounds 2, 3; a spare in 4
    for r in (0, 2, 3):
        assert out[r]["value"]["round"] == 4 and out[r]["value"]["sum"] == 3, out
    assert out[0]["value"]["spare_ranks"] == [1]  # back, as a spare
    probes = _events(tmp_path, "host_probe")
    assert [e["passed"] for e in probes] == [False, True], probes
    assert "marker" in probes[0]["result"]
    (back,) = _events(tmp_path, "host_readmitted")
    assert back["quarantined_host"] == "h1" and back["round"] == 4
    assert qfile.read_text() == ""  # nobody is out at the end


def test_the_job_ends_naming_the_host_when_too_few_ranks_are_left(tmp_path: Path) -> None:
    qfile = tmp_path / "exclude"
    results = run_ranks(jobs.too_few_left, 2, args=(str(qfile),), timeout=120, rank_env=_hosts)
    for res in (r.get() for r in results):
        assert res["type"] == "HostQuarantinedError", res
        assert "h1: 2 faults within 3600 s" in res["error"], res
        assert "min_active_world_size=2" in res["error"], res
    assert qfile.read_text() == "h1\n"


def test_a_death_is_blamed_on_the_host_the_rank_was_seen_on(tmp_path: Path) -> None:
    results = run_ranks(
        jobs.dies,
        3,
        args=(str(tmp_path / "exclude"),),
        timeout=120,
        env={"TRAINGUARD_EVENTS_DIR": str(tmp_path)},
        rank_env=_hosts,
    )
    assert results[1].exitcode == 3, results[1]
    assert results[0].get()["value"] == {"round": 1, "rank": 0, "sum": 2}
    assert results[2].get()["value"] == {"round": 1, "rank": 1, "sum": 2}  # the spare
    blamed = _events(tmp_path, "fault_attributed")
    # the dead rank wrote no record of round 1: its host is the one it was seen on before
    assert [(e["fault_host"], e["fault_rank"], e["fault_kind"]) for e in blamed] == [
        ("h1", 1, "RankGone")
    ], blamed
