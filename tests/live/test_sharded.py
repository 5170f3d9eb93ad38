"""Sharded live state (issue 39, item 1): FSDP2 and HSDP models on CPU/gloo under the restart
wrapper, real faults, every rank's local shards of the parameters and of the optimizer state
compared bit for bit with a fault-free run on the same ranks (tests/live/_sharded_jobs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests.live._sharded_jobs import sharded_job

STEPS = 8


def _run(
    tmp: Path, world: int, active: int, mesh: tuple[int, ...], faults: list[Any], **kw: Any
) -> Any:
    tmp.mkdir()
    results = run_ranks(
        sharded_job, world, args=(STEPS, active, mesh, faults, str(tmp)), kwargs=kw, timeout=150
    )
    return results


def _round(values: list[dict[str, Any]], round_: int) -> dict[int, dict[str, Any]]:
    return {rec["rank"]: rec for v in values for rec in v["recoveries"] if rec["round"] == round_}


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The fault-free HSDP 2x2 run's digest of each rank's shards, by rank."""
    ref = [r.get() for r in _run(tmp_path_factory.mktemp("hsdp") / "ref", 4, 4, (2, 2), [])]
    return [v["digest"] for v in sorted(ref, key=lambda v: v["rank"])]


def test_hsdp_2x2_an_exception_in_backward_then_a_torn_step_recompute_nothing(
    tmp_path: Path, hsdp_reference: list[str]
) -> None:
    # rank 2 raises inside backward at step 2; rank 1 is torn inside optimizer.step() at 5
    faults = [("backward", 2, 2), ("torn", 1, 5)]
    values = [r.get() for r in _run(tmp_path / "job", 4, 4, (2, 2), faults)]
    assert [v["digest"] for v in values] == hsdp_reference
    assert all(v["step"] == STEPS for v in values)
    first = int((tmp_path / "job" / "fault-0").read_text())
    second = int((tmp_path / "job" / "fault-1").read_text())
    # the backward fault: every rank kept its own shards (moved into the rebuilt model)
    again = _round(values, first + 1)
    assert sorted(again) == [0, 1, 2, 3]
    assert all(
        rec["live"] and rec["step"] == 2 and rec["recomputed"] == 0 for rec in again.values()
    )
    assert all(rec["receivers"] == [] for rec in again.values())
    # the torn step: rank 1 (shard 1 of replica 0) receives its shards from rank 3 (shard 1
    # of replica 1), the only rank that holds the same ones; the others keep theirs
    again = _round(values, second + 1)
    assert all(
        rec["live"] and rec["step"] == 6 and rec["recomputed"] == 0 for rec in again.values()
    )
    assert again[1]["receivers"] == [1] and again[1]["received_from"] == 3
    # what travelled is rank 1's local shards (and the small rest: steps, RNG), not the
    # global tensors
    assert again[1]["nbytes"] == again[1]["local_bytes"] < again[1]["global_bytes"]
    assert all(again[r]["received_from"] is None for r in (0, 2, 3))


def test_fsdp2_1d_an_exception_in_backward_keeps_every_shard(tmp_path: Path) -> None:
    ref = [r.get() for r in _run(tmp_path / "ref", 2, 2, (2,), [])]
    values = [r.get() for r in _run(tmp_path / "job", 2, 2, (2,), [("backward", 1, 3)])]
    assert [v["digest"] for v in values] == [v["digest"] for v in ref]
    after = int((tmp_path / "job" / "fault-0").read_text()) + 1
    again = _round(values, after)
    # no replica exists, and none is needed: nobody was torn
    assert sorted(again) == [0, 1]
    assert all(
        rec["live"] and rec["step"] == 3 and rec["recomputed"] == 0 for rec in again.values()
    )
    assert all(rec["receivers"] == [] for rec in again.values())


def test_fsdp2_1d_a_torn_step_falls_back_no_replica_holds_the_shard(tmp_path: Path) -> None:
    values = [r.get() for r in _run(tmp_path / "job", 2, 2, (2,), [("torn", 0, 3)])]
    after = int((tmp_path / "job" / "fault-0").read_text()) + 1
    again = _round(values, after)
    assert all(not rec["live"] and "no untorn replica" in rec["fallback"] for rec in again.values())
    assert len({v["digest"] for v in values}) == 2  # each rank its own shards, at step 8
    assert all(v["step"] == STEPS for v in values)


def test_hsdp_2x2_sigkill_with_a_spare_the_spare_receives_the_lost_shards(
    tmp_path: Path, hsdp_reference: list[str]
) -> None:
    # rank 3 (shard 1 of replica 1) is killed after backward of step 4; the others finish
    # that update. The spare becomes rank 3 and gets shard 1 (and its Adam state) from rank 1
    results = _run(tmp_path / "job", 5, 4, (2, 2), [("kill", 3, 4)])
    assert results[3].exitcode == -9
    values = sorted((r.get() for r in results if r.rank != 3), key=lambda v: v["rank"])
    assert [v["digest"] for v in values] == hsdp_reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1, 2, 3]
    assert all(
        rec["live"] and rec["step"] == 5 and rec["recomputed"] == 0 for rec in again.values()
    )
    assert again[3]["receivers"] == [3] and again[3]["received_from"] == 1
    assert all(again[r]["received_from"] is None for r in (0, 1, 2))


def test_hsdp_2x2_a_corrupted_transfer_of_shards_falls_back(
    tmp_path: Path, hsdp_reference: list[str]
) -> None:
    # rank 1 is torn; rank 3, the only other holder of its shards, flips a bit of what it
    # sends: the checksum refuses it, and with no donor left every rank falls back (a fresh
    # build here: step 0) and still ends identical
    values = [
        r.get() for r in _run(tmp_path / "job", 4, 4, (2, 2), [("torn", 1, 5)], tamper_rank=3)
    ]
    assert [v["digest"] for v in values] == hsdp_reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1, 2, 3]
    for rec in again.values():
        assert not rec["live"] and "live transfer failed on every donor" in rec["fallback"]
        assert "checksum" in rec["fallback"] or "refused" in rec["fallback"]


def test_fsdp2_a_world_that_shrinks_reshards_so_every_rank_falls_back(tmp_path: Path) -> None:
    # 3 ranks, rank 2 killed, no spare: the survivors' mesh has 2 ranks, their shards of the
    # last round (7 or 6 of 16 rows) are not the new ones (8 rows): nobody holds this round's
    # shards, and the round falls back instead of resuming from the wrong rows
    results = _run(tmp_path / "job", 3, 3, (), [("kill", 2, 3)])
    assert results[2].exitcode == -9
    values = [results[0].get(), results[1].get()]
    assert all(v["step"] == STEPS for v in values)
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        assert not rec["live"] and "no untorn replica" in rec["fallback"], rec
        assert "a first start" not in rec["fallback"]


def test_tensor_parallel_an_exception_in_forward_keeps_every_shard(tmp_path: Path) -> None:
    # tensor parallel on 2 ranks (Shard(0), Shard(1) and a replicated bias): no replica of a
    # shard, none needed: the fault strikes in forward (once both ranks finished the last
    # update), nobody updated, every rank keeps its own. (This model's backward and update
    # have no collective: without that barrier a fault can find the other rank one update
    # ahead or behind, and the round rightly falls back: no rank holds the other's shard.)
    ref = [r.get() for r in _run(tmp_path / "ref", 2, 2, (2,), [], tp=True)]
    values = [r.get() for r in _run(tmp_path / "job", 2, 2, (2,), [("forward", 0, 3)], tp=True)]
    assert [v["digest"] for v in values] == [v["digest"] for v in ref]
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    assert all(
        rec["live"] and rec["step"] == 3 and rec["receivers"] == [] for rec in again.values()
    )


def test_a_partial_placement_is_refused_naming_it() -> None:
    from tests.live._sharded_jobs import partial_job

    message = run_ranks(partial_job, 1, timeout=60)[0].get()
    assert "model.sum is a DTensor with a Partial placement" in message
