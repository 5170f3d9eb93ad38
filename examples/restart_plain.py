"""In-process restart with plain processes: 3 ranks, rank 1 fails once, everyone restarts.

Run: ``python examples/restart_plain.py``. The script starts its own ranks (as a launcher
would) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.

Each process builds its :class:`LocalCheckpointManager` once, before the wrapper, and uses it
in every round: the manager re-binds to the new round's process group by itself, and after the
fault each rank restores its part from memory (the staging buffer of its last save), reading no
file.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile

import torch
import torch.distributed as dist

import trainguard.restart as tr
from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

STEPS = 20


@tr.Wrapper(max_rounds=5, barrier_timeout=60)
def train(call: tr.CallWrapper, mgr: LocalCheckpointManager) -> float:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* of this round
    latest = mgr.find_latest()  # every rank, together; the manager re-binds to this round
    state = mgr.load(latest) if latest is not None else {"weight": torch.zeros(1), "step": 0}
    if latest is not None and call.rank == 0:
        print(f"round {call.round}: resumed at step {latest} from {mgr.last_load}")
    weight, start = state["weight"], int(state["step"])
    for step in range(start, STEPS):
        if call.round == 0 and call.rank == 1 and step == 7:
            raise RuntimeError("simulated fault on rank 1")
        grad = torch.ones(1) * (call.rank + 1)
        dist.all_reduce(grad)  # the other ranks block here when rank 1 fails
        weight = weight - 0.01 * grad
        if (step + 1) % 5 == 0:
            mgr.save({"weight": weight, "step": step + 1}, step + 1)  # a copy to shared memory
    mgr.wait()
    dist.destroy_process_group()
    if call.rank == 0:
        print(f"round {call.round}: finished {STEPS} steps, weight {weight.item():.3f}")
    return float(weight.item())


def rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # built once per process, outside the wrapped function: it outlives the rounds
    with LocalCheckpointManager(
        f"{root}/rank{rank}", replication=CliqueReplication(factor=2, jump=1), timeout=60
    ) as mgr:
        train(mgr=mgr)  # the Wrapper passes the CallWrapper as `call`


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=rank_main, args=(r, 3, port, root)) for r in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    raise SystemExit(max(p.exitcode or 0 for p in procs))
