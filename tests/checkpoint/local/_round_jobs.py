"""Rank functions for the tests of checkpointers that outlive restart rounds (module level, so
spawned ranks can import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests.checkpoint.conftest import assert_same, sample_state, snapshot
from trainguard import events
from trainguard.checkpoint import AsyncCheckpointer, CliqueReplication, LocalCheckpointManager
from trainguard.checkpoint.format.read import load_file
from trainguard.checkpoint.local import _inventory


def _state(step: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(100 * step + rank)  # the model's initialization and "rng" too
    state = sample_state(seed=100 * step + rank)
    state["step"] = step
    return state


def persistent_job(out: str, rounds: int) -> dict[str, Any]:
    """Both checkpointers built once, before the wrapper; ``rounds`` rounds end with a fault
    (rank ``round % world`` raises: in even rounds after the saves are durable, in odd rounds
    right after the local save, while its replication runs), the last one completes. Each round
    resumes from the newest local checkpoint, checks it bit for bit against its file, and
    records what the process holds."""
    rank = int(os.environ["RANK"])
    events.configure(Path(out) / "events")
    root = Path(out) / f"node{rank}"
    local = LocalCheckpointManager(root, replication=CliqueReplication(2), keep=2, timeout=30)
    disk = AsyncCheckpointer(commit_timeout=30)
    writers = (local._writer.pid, disk.writer_pid)
    per_round: list[dict[str, Any]] = []

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60, max_rounds=rounds + 1)
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        it = local.find_latest()
        step = 0
        info: dict[str, Any] = {"round": call.round, "found": it}
        if it is not None:
            state = local.load(it)
            own = _inventory.part_path(str(root), it, call.rank, call.rank)
            from_file, _ = load_file(own)
            assert_same(state, from_file)  # restore from memory == restore from the file
            assert_same(state, _state(it, call.rank))
            info["source"] = (local.last_load or {}).get("source")
            step = it
        info["writers"] = [local._writer.pid, disk.writer_pid]
        info.update(snapshot())
        per_round.append(info)
        dist.barrier()  # every rank has recorded before the victim can raise
        step += 1
        local.save(_state(step, call.rank), step)
        victim = call.round < rounds and call.rank == call.round % call.world_size
        if victim and call.round % 2 == 1:
            raise ValueError(f"fault in round {call.round}, replication under way")
        local.wait()
        disk.save({"w": torch.full((4,), float(step))}, Path(out) / "disk" / f"r{call.round}")
        disk.wait()
        dist.barrier()
        if victim:
            raise ValueError(f"fault in round {call.round}")
        if call.round < rounds:
            dist.all_reduce(torch.ones(1))  # blocks until the abort releases it
            raise AssertionError("the collective was not aborted")
        dist.destroy_process_group()
        return call.round

    result = train()
    local.close()
    disk.close()
    return {
        "result": result,
        "writers": writers,
        "rounds": per_round,
        "after": snapshot(),
    }


def spare_job(out: str, ranks: int, roots: list[str]) -> dict[str, Any]:
    """``ranks`` active ranks and spares; every process builds its manager before the wrapper
    (the spares with ``spare_roots``). Rank 1 saves two iterations with the others, waits until
    a spare has prefetched the second one, then kills itself (SIGKILL); the spare takes its
    rank and resumes."""
    process = int(os.environ["RANK"])
    events.configure(Path(out) / "events")
    spare = process >= ranks
    local = LocalCheckpointManager(
        roots[process],
        replication=CliqueReplication(2),
        keep=2,
        timeout=30,
        spare_roots=roots if spare else None,
        spare_interval=0.2,
    )
    loads: list[dict[str, Any]] = []

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(ranks),
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        it = local.find_latest()
        if it is not None:
            state = local.load(it)
            assert_same(state, _state(it, call.rank))
            loads.append({"round": call.round, "rank": call.rank, **(local.last_load or {})})
            return it
        for step in (1, 2):
            local.save(_state(step, call.rank), step)
            local.wait()
        dist.barrier()
        if call.rank == 1:
            _wait_for_prefetch(Path(out) / "events", 2)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))  # blocks until the abort releases it
        raise AssertionError("the collective was not aborted")

    result = train()
    local.close()
    return {"result": result, "process": process, "loads": loads, "after": snapshot()}


def _wait_for_prefetch(directory: Path, iteration: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for e in events.read_events(directory):
            if e["kind"] == "spare_prefetch" and e["iteration"] == iteration:
                return
        time.sleep(0.05)
    raise AssertionError("no spare prefetched the iteration")
