"""Quarantine with plain processes: 4 ranks on 4 "hosts", 3 active; one host keeps failing.

Run: ``python examples/restart_quarantine.py``. The script starts its own ranks (as a launcher
would); each names its host through ``TRAINGUARD_HOST_NAME`` (``node0`` .. ``node3``), as if it
ran on a machine of its own. The rank on ``node1`` raises at step 5 whenever it is active.
After its second fault ``node1`` is quarantined: the spare on ``node3`` takes rank 1's number
(``FillGaps``), the job finishes at 3 active ranks, and ``exclude-hosts`` (in a temporary
directory, printed at the end) lists ``node1`` for the scheduler.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import trainguard.restart as tr

STEPS = 10


def train(call: tr.CallWrapper) -> float:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* of this round
    weight = torch.zeros(1)
    for step in range(STEPS):
        loss = weight.sum() + 1.0
        if os.environ["TRAINGUARD_HOST_NAME"] == "node1" and step == 5:
            loss = loss * float("nan")  # this host's GPU computes garbage
        call.check_finite(loss)  # a NaN here is this rank's fault, before the all-reduce
        grad = torch.ones(1)
        dist.all_reduce(grad)
        weight = weight - 0.1 * grad / call.world_size
        call.ping()
    dist.destroy_process_group()
    if call.rank == 0:
        print(f"round {call.round}: {call.world_size} active ranks, weight {weight.item():.2f}")
    return float(weight.item())


def rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TRAINGUARD_HOST_NAME=f"node{rank}",
    )
    wrapped = tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(3),
        quarantine=tr.Quarantine(after=2, window=3600, probes=[], file=f"{root}/exclude-hosts"),
        barrier_timeout=60,
    )(train)
    wrapped()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=rank_main, args=(r, 4, port, root)) for r in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        excluded = Path(root, "exclude-hosts").read_text().split()
        print(f"quarantined (exclude-hosts): {excluded}")
    raise SystemExit(max(p.exitcode or 0 for p in procs))
