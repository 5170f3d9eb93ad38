"""The preemption stop step is the call's, under the job secret: a fault that starts a new
round before every rank read it still stops every rank at that step, saved; a process that
reaches the stores but does not know the secret can neither stop the job nor keep a real
preemption from saving."""

from __future__ import annotations

import json
import signal
from datetime import timedelta
from pathlib import Path

import pytest

from tests._dist import RankGroup, RankResult, run_ranks
from tests.restart._preempt_jobs import progress, train_job
from trainguard.checkpoint import latest, load
from trainguard.coord import Keyspace
from trainguard.restart import Preempted

pytestmark = pytest.mark.timeout(180)

STEPS = 60
JOB = "preempt-keys"  # the job token: a forger may know it (it is no secret)


def _preempted(result: RankResult) -> Preempted:
    assert result.exc_type == "trainguard.restart.preempt.Preempted", (
        f"rank {result.rank}: {result.exc_type}: {result.error}\n{result.traceback}"
    )
    assert isinstance(result.exception, Preempted)
    return result.exception


def _logs(out: Path, rank: int) -> str:
    return (out / "logs" / f"rank-{rank}.log").read_text()


def test_a_fault_during_a_preemption_stops_every_rank_at_the_agreed_step_and_saves_it(
    tmp_path: Path,
) -> None:
    # round 0: SIGTERM to every process during step 12; rank 0 proposes 14 at the boundary
    # 13, rank 1 raises there before it read it; round 1 resumes both from step 10
    out = tmp_path / "run"
    results = run_ranks(
        train_job,
        2,
        args=(str(out),),
        kwargs={"steps": STEPS, "fault_at": 13},
        timeout=120,
    )
    stops = {r.rank: _preempted(r).step for r in results}
    assert stops == {0: 14, 1: 14}, stops  # one step, the one rank 0 proposed in round 0
    assert all(_preempted(r).saved for r in results)
    assert "fault in round 0: RuntimeError: a fault at step 13" in _logs(out, 1)
    assert _logs(out, 0).count("proposed the preemption stop at step 14") == 1
    assert "proposed the preemption stop" not in _logs(out, 1)  # it read rank 0's
    for rank in (0, 1):
        steps = [p["step"] for p in progress(out, rank)]
        assert steps.count(10) == 2 and max(steps) == 13, steps  # round 1 resumed from 10
    newest = latest(out / "ckpt")
    assert newest is not None and newest.name == "step_000014"
    assert [load(newest, rank=r)["step"] for r in (0, 1)] == [14, 14]


def _forge(out: Path, coord_port: int, value: bytes) -> None:
    """What a process that reaches the stores but lacks the secret can do: set every stop
    key it can name, the old fixed one and the call's without the secret, on the round store
    (its address as anyone can find it) and on the coordination store (``MASTER_PORT``)."""
    import torch.distributed as dist

    where = json.loads((out / "round-store.json").read_text())
    keys = ["trainguard/preempt/stop", Keyspace(JOB, 0).prefix + "preempt/stop"]
    for host, port in ((where["host"], int(where["port"])), ("127.0.0.1", coord_port)):
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        for key in keys:
            client.set(key, value)
        del client


def test_a_stop_step_forged_without_the_secret_neither_stops_the_job_nor_blocks_the_save(
    tmp_path: Path,
) -> None:
    # forge a stop at step 3 once both ranks train: they go on (10 more steps); then a stop
    # so far away that no preemption would ever reach it, and a real SIGTERM to every
    # process: they stop at one step, saved
    out = tmp_path / "run"
    with RankGroup(
        train_job,
        2,
        args=(str(out),),
        kwargs={"steps": STEPS, "step_time": 0.05, "announce": True},
        env={"TRAINGUARD_JOB_ID": JOB},
        timeout=120,
    ) as group:
        group.start()
        group.wait_until(
            lambda: (
                (out / "round-store.json").exists()
                and all(any(p["step"] >= 5 for p in progress(out, r)) for r in (0, 1))
            ),
            timeout=60,
        )
        _forge(out, group.port, b"3")
        forged_at = max(p["step"] for r in (0, 1) for p in progress(out, r))
        assert forged_at < STEPS - 20, "the job ran past the forgery: slow it down"
        group.wait_until(
            lambda: all(
                any(p["step"] >= forged_at + 10 for p in progress(out, r)) or not group.is_alive(r)
                for r in (0, 1)
            ),
            timeout=60,
        )
        assert all(group.is_alive(r) for r in (0, 1)), "the forged stop step stopped the job"
        _forge(out, group.port, b"999999999")
        forged_at = max(p["step"] for r in (0, 1) for p in progress(out, r))
        for rank in (0, 1):
            group.kill(rank, signal.SIGTERM, whole_group=True)
        results = group.join()
        assert group.leftovers == []
    stops = {_preempted(r).step for r in results}
    assert len(stops) == 1, stops
    (stop,) = stops
    assert stop is not None and forged_at < stop < STEPS, (forged_at, stop)
    assert all(_preempted(r).saved for r in results)
    newest = latest(out / "ckpt")
    assert newest is not None and newest.name == f"step_{stop:06d}"
