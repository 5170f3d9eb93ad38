"""In-process restart with plain processes: 3 ranks, rank 1 fails once, everyone restarts.

Run: ``python examples/restart_plain.py``. The script starts its own ranks (as a launcher
would) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import torch
import torch.distributed as dist

import trainguard.restart as tr

STEPS = 20
checkpoint: dict[str, object] = {}  # survives restarts: same process


@tr.Wrapper(max_rounds=5, barrier_timeout=60)
def train(call: tr.CallWrapper) -> float:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* of this round
    weight = checkpoint.get("weight", torch.zeros(1))
    start = int(checkpoint.get("step", 0))  # type: ignore[arg-type]
    assert isinstance(weight, torch.Tensor)
    for step in range(start, STEPS):
        if call.round == 0 and call.rank == 1 and step == 7:
            raise RuntimeError("simulated fault on rank 1")
        grad = torch.ones(1) * (call.rank + 1)
        dist.all_reduce(grad)  # the other ranks block here when rank 1 fails
        with call.atomic():  # a restart never lands between these two lines
            weight = weight - 0.01 * grad
            checkpoint.update(weight=weight.clone(), step=step + 1)
    dist.destroy_process_group()
    if call.rank == 0:
        print(f"round {call.round}: finished {STEPS} steps, weight {weight.item():.3f}")
    return float(weight.item())


def rank_main(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    train()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 3, port)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    raise SystemExit(max(p.exitcode or 0 for p in procs))
