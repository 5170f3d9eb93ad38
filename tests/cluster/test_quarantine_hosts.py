"""Quarantine on emulated hosts: three hosts (network namespaces with their own host names),
one rank each. A flaky host: two ranks active, the second host's rank raises whenever it is
active; after its second fault the host is quarantined, the spare on the third host takes its
rank number and the job completes at full active size; the quarantine file names the host.
A software bug: every rank raises the same error at the same place; no host is blamed."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster._hosts import Cluster
from trainguard.events import read_events

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]


def _run(c: Cluster, tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], Path]:
    """The three ranks of ``_quarantine_rank.py`` in ``mode``, one per host, to their end: their
    results and the events' directory."""
    out, events = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    env = dict(
        os.environ,
        WORLD_SIZE="3",
        MASTER_ADDR=c.hosts[0].name,
        MASTER_PORT="29500",
        TRAINGUARD_JOB_SECRET=uuid.uuid4().hex,
        TRAINGUARD_EVENTS_DIR=str(events),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    )
    env.pop("TRAINGUARD_HOST_NAME", None)  # each host's own name
    procs = {}
    for rank, host in enumerate(c.hosts):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": "0"}
        argv = [sys.executable, str(ROOT / "tests/cluster/_quarantine_rank.py"), str(out), mode]
        procs[rank] = c.start(host, argv, log=tmp_path / f"rank{rank}.log", env=rank_env)
    for rank, proc in procs.items():
        assert proc.wait(120) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(3)], events


def test_a_flaky_host_is_quarantined_and_a_spare_on_another_host_takes_its_place(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    results, events = _run(cluster(3), tmp_path, "flaky")
    out = tmp_path / "out"
    assert results[1] == {"rounds": [0, 1], "value": None}  # h2: never active again
    assert results[0]["value"] == {"round": 2, "rank": 0, "sum": 2}
    assert results[2]["value"] == {"round": 2, "rank": 1, "sum": 2}  # h3's spare, h2's number
    assert (out / "exclude").read_text() == "h2\n"
    seen = read_events(events)
    blamed = [(e["fault_host"], e["counted"]) for e in seen if e["kind"] == "fault_attributed"]
    assert blamed == [("h2", True), ("h2", True)], blamed
    taken = [e for e in seen if e["kind"] == "host_quarantined"]
    assert [e["quarantined_host"] for e in taken] == ["h2"], taken


def test_the_same_error_at_the_same_place_on_every_host_is_blamed_on_none(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """Every rank, one per host, raises the same ValueError at the same line each round: a
    software bug. No host stays quarantined and the repeat detection ends the job as before.
    (When the first rank's fault interrupts the others before they raise, twice, its host goes
    out for a round and is let go once another host raises it: the skewed test below.)"""
    results, events = _run(cluster(3), tmp_path, "software")
    seen = read_events(events)
    taken = [e["quarantined_host"] for e in seen if e["kind"] == "host_quarantined"]
    released = [e["quarantined_host"] for e in seen if e["kind"] == "host_released"]
    assert taken == released, (taken, released)
    for rank, res in enumerate(results):
        full = [0, 1, 2] if not taken or f"h{rank + 1}" not in taken else [0, 1]
        assert res["rounds"] == full, (res, taken)
        assert res["error"].startswith("RetryLimitError: "), res  # not HostQuarantinedError
        assert "3 rounds in a row failed with the same error" in res["error"], res
    exclude = tmp_path / "out" / "exclude"
    assert not exclude.exists() or exclude.read_text() == ""
    blamed = [e for e in seen if e["kind"] == "fault_attributed"]
    assert len(blamed) == 3, blamed  # rounds 0, 1 and 2, reported on entering the next
    assert {e["fault_host"] for e in blamed} <= {"h1", "h2", "h3"}, blamed  # real host names
    assert not any(e["counted"] for e in blamed[2:]), blamed  # seen on other hosts by then


def test_a_host_out_for_what_proves_a_software_bug_is_let_go(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """The ranks on h2 and h3 raise 3 s after h1's: h1's fault interrupts them in rounds 0 and
    1, so h1 alone raised it twice and goes out. In round 2 the others raise it: h1 is let go
    at once (no probes), comes back in round 3, and the repeats end the job (4 allowed)."""
    results, events = _run(cluster(3), tmp_path, "software-skewed")
    assert results[0]["rounds"] == [0, 1, 3], results  # out in round 2 only
    assert all(res["rounds"] == [0, 1, 2, 3] for res in results[1:]), results
    for res in results:
        assert res["error"].startswith("RetryLimitError: "), res
        assert "4 rounds in a row failed with the same error" in res["error"], res
    assert (tmp_path / "out" / "exclude").read_text() == ""  # written "h1" in round 2
    seen = read_events(events)
    quarantine = ("host_quarantined", "host_released", "host_readmitted")
    kinds = [(e["kind"], e["quarantined_host"]) for e in seen if e["kind"] in quarantine]
    assert kinds == [("host_quarantined", "h1"), ("host_released", "h1")], kinds
    blamed = [(e["fault_host"], e["counted"]) for e in seen if e["kind"] == "fault_attributed"]
    assert blamed[:2] == [("h1", True), ("h1", True)], blamed
    assert blamed[2][0] in ("h2", "h3") and not any(c for _, c in blamed[2:]), blamed
