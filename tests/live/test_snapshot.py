"""Peer snapshots (issue 39, item 2): FSDP2 on a 1-D mesh, where no replica of a shard exists.

Real ranks (tests/_dist.py), real gloo, real ``fully_shard`` on CPU (tests/live/_sharded_jobs.py);
every rank's local parameter shards and AdamW state compared bit for bit with a fault-free run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests.live._sharded_jobs import sharded_job
from trainguard.errors import ConfigError
from trainguard.live import LiveState
from trainguard.live._plan import Record, SnapPlan, snapshot_plan
from trainguard.live._snapshot import ring

STEPS = 8


def _run(tmp: Path, world: int, faults: list[Any], **kw: Any) -> Any:
    tmp.mkdir()
    return run_ranks(
        sharded_job, world, args=(STEPS, 2, (2,), faults, str(tmp)), kwargs=kw, timeout=150
    )


def _round(values: list[dict[str, Any]], round_: int) -> dict[int, dict[str, Any]]:
    return {rec["rank"]: rec for v in values for rec in v["recoveries"] if rec["round"] == round_}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The fault-free FSDP2 1-D run's digest of each rank's shards, by rank (no snapshots)."""
    ref = [r.get() for r in _run(tmp_path_factory.mktemp("fsdp") / "ref", 2, [])]
    return [v["digest"] for v in sorted(ref, key=lambda v: v["rank"])]


def test_fsdp2_1d_sigkill_with_a_spare_recovers_from_the_buddys_snapshot(
    tmp_path: Path, reference: list[str]
) -> None:
    # rank 1 is killed after backward of step 4 (its state at 4, its snapshot of 4 on rank 0);
    # rank 0 finishes that update (5). The spare becomes rank 1 and gets shard 1 of step 4
    # from rank 0's copy; rank 0 goes back to its own snapshot of 4: 1 step recomputed
    results = _run(tmp_path / "job", 3, [("kill", 1, 4)], snapshot_every=1)
    assert results[1].exitcode == -9
    values = sorted((r.get() for r in results if r.rank != 1), key=lambda v: v["rank"])
    assert [v["digest"] for v in values] == reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        assert rec["live"] and rec["snapshot"], rec
        assert rec["step"] == 4 and rec["recomputed"] == 1, rec
        assert rec["receivers"] == [1]
    assert again[1]["received_from"] == 0 and again[0]["received_from"] is None
    assert again[1]["nbytes"] == again[1]["local_bytes"]  # its shards, not the global tensors


def test_fsdp2_1d_sigkill_with_snapshots_every_2_steps_recomputes_at_most_2(
    tmp_path: Path, reference: list[str]
) -> None:
    # snapshots of steps 2, 4, 6: rank 1 killed at step 5 (its newest copy: step 4); rank 0
    # finished step 5 (state 6, snapshot of 6, the one of 4 kept): both go to step 4
    results = _run(tmp_path / "job", 3, [("kill", 1, 5)], snapshot_every=2)
    values = sorted((r.get() for r in results if r.rank != 1), key=lambda v: v["rank"])
    assert [v["digest"] for v in values] == reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    for rec in again.values():
        assert rec["live"] and rec["snapshot"] and rec["step"] == 4, rec
        assert rec["recomputed"] == 2, rec


def test_fsdp2_1d_a_kill_before_the_first_snapshot_falls_back_saying_so(
    tmp_path: Path, reference: list[str]
) -> None:
    # snapshot_every=3: rank 1 killed in step 1, before the first snapshot (of step 3): no
    # copy of its shard exists: the checkpoint path (a fresh start here), and the reason
    # says why the snapshots did not help (the plan's "do not line up" case: test_plan below)
    results = _run(tmp_path / "job", 3, [("kill", 1, 1)], snapshot_every=3)
    values = sorted((r.get() for r in results if r.rank != 1), key=lambda v: v["rank"])
    assert [v["digest"] for v in values] == reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        assert not rec["live"] and "no untorn replica" in rec["fallback"], rec
        assert rec["fallback"].endswith("; no rank holds a peer snapshot"), rec


def test_fsdp2_1d_a_torn_step_rolls_every_rank_back_one_snapshot(
    tmp_path: Path, reference: list[str]
) -> None:
    # rank 0 is torn inside optimizer.step() of step 3 once rank 1 finished it: no replica
    # of rank 0's shard exists; both go back to their own snapshots of step 3
    values = [r.get() for r in _run(tmp_path / "job", 2, [("torn", 0, 3)], snapshot_every=1)]
    assert [v["digest"] for v in values] == reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    for rec in again.values():
        assert rec["live"] and rec["snapshot"] and rec["step"] == 3, rec
        assert rec["recomputed"] == 1 and rec["receivers"] == [], rec


def test_fsdp2_1d_an_exception_with_snapshots_recomputes_nothing(
    tmp_path: Path, reference: list[str]
) -> None:
    # nobody torn: every rank keeps its own live state, the snapshots are not used
    values = [r.get() for r in _run(tmp_path / "job", 2, [("backward", 1, 3)], snapshot_every=1)]
    assert [v["digest"] for v in values] == reference
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        assert rec["live"] and not rec["snapshot"], rec
        assert rec["step"] == 3 and rec["recomputed"] == 0 and rec["receivers"] == [], rec


def test_fsdp2_1d_sigkill_without_snapshots_falls_back(tmp_path: Path) -> None:
    # snapshots off: today's path, the lost shard exists nowhere
    results = _run(tmp_path / "job", 3, [("kill", 1, 4)])
    values = [r.get() for r in results if r.rank != 1]
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    for rec in again.values():
        assert not rec["live"] and "no untorn replica" in rec["fallback"], rec
        assert "snapshot" not in rec["fallback"]


def memory_job(limit: int) -> str:
    """One rank, FSDP2 on a mesh of 1, snapshots under ``limit`` bytes: what the first update
    says."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.live._sharded_jobs import _batch, build

    dist.init_process_group("gloo")
    try:
        net, opt = build(init_device_mesh("cpu", (1,)))
        live = LiveState(model=net, optimizer=opt, snapshot_every=1, snapshot_memory_limit=limit)
        live.recover()
        live.restored(0)
        x, y = _batch(0, 0, 1)
        import torch

        torch.nn.functional.cross_entropy(net(x), y).backward()
        try:
            with live.update(0):
                opt.step()
        except ConfigError as exc:
            return str(exc)
        finally:
            live.flush()
        return "accepted"
    finally:
        dist.destroy_process_group()


def test_a_snapshot_over_the_memory_limit_is_refused_naming_the_fix() -> None:
    refused = run_ranks(memory_job, 1, args=(1000,), timeout=60)[0].get()
    assert "over LiveState(snapshot_memory_limit=1000)" in refused
    assert "raise the limit" in refused and "snapshot_every=None" in refused
    assert run_ranks(memory_job, 1, args=(1 << 30,), timeout=60)[0].get() == "accepted"


@pytest.mark.parametrize(
    ("every", "limit"), [(-1, None), (1.5, None), (True, None), (1, 0), (1, "1G")]
)
def test_bad_snapshot_options_are_refused_when_built(every: Any, limit: Any) -> None:
    with pytest.raises(ConfigError, match="snapshot_"):
        LiveState(model=None, snapshot_every=every, snapshot_memory_limit=limit)


def test_the_ring_alternates_hosts() -> None:
    assert ring([7, 7, 7]) == [0, 1, 2]  # one host: the next rank
    order = ring([1, 1, 2, 2])
    assert order == [0, 2, 1, 3]
    assert all([1, 1, 2, 2][order[i]] != [1, 1, 2, 2][order[(i + 1) % 4]] for i in range(4))


def _rec(rank: int, step: int, torn: bool, key: int, **snaps: int) -> Record:
    return Record(rank, step, torn, key, **snaps)


def test_the_snapshot_plan_takes_the_newest_step_every_shard_is_held_at() -> None:
    # rank 1 (key 11) lost; rank 0 at 5 live, its own snapshots of 5 and 4, rank 1's of 4
    records = [
        _rec(
            0,
            5,
            False,
            10,
            own_step=5,
            own_key=10,
            prev_step=4,
            prev_key=10,
            held_step=4,
            held_key=11,
            every=1,
        ),
        _rec(1, -1, False, 11, every=1),
    ]
    got = snapshot_plan(records)
    assert isinstance(got, SnapPlan)
    assert got.step == 4 and got.newest == 5
    assert got.actions == {0: ("own", -1, ""), 1: ("recv", 0, "held")}
    # the copy of rank 1's shard was not held: nothing lines up
    records[0] = _rec(0, 5, False, 10, own_step=5, own_key=10, prev_step=4, prev_key=10, every=1)
    why = snapshot_plan(records)
    assert isinstance(why, str) and "do not line up" in why


def test_tensor_parallel_a_torn_step_rolls_back_to_the_snapshots(tmp_path: Path) -> None:
    # tensor parallel on 2 ranks without data parallelism (Shard(0), Shard(1), a replicated
    # bias): no rank holds the other's shards; rank 1 is torn in step 3, both go back to
    # their own snapshots of step 3
    ref = [r.get() for r in _run(tmp_path / "ref", 2, [], tp=True)]
    faults = [("torn", 1, 3)]
    values = [r.get() for r in _run(tmp_path / "job", 2, faults, tp=True, snapshot_every=1)]
    assert [v["digest"] for v in values] == [v["digest"] for v in ref]
    again = _round(values, int((tmp_path / "job" / "fault-0").read_text()) + 1)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        assert rec["live"] and rec["snapshot"] and rec["step"] == 3, rec
        assert rec["recomputed"] == 1 and rec["receivers"] == [], rec
