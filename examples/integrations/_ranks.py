"""Start the examples' ranks on this machine: N spawned processes, one free port, one temp root."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable


def start(target: Callable[[str], None], world: int, prefix: str) -> str:
    """Run ``target(root)`` in ``world`` processes with RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT set (as torchrun would); returns the temp root they shared."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix=prefix)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(target, r, world, port, root)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return root


def _rank(target: Callable[[str], None], rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    target(root)
