"""One rank of a wrapped job on an emulated host, under the node watcher (which arrives
at the barriers for its ranks), for the node liveness test.

Run as ``python tests/cluster/_node_rank.py OUT_DIR`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set. It writes its node watcher's pid (from its handshake) to
``OUT_DIR/watcher-<rank>``, all-reduces until its round is ended by a fault (60 s at most),
then in the next rounds runs 10 steps and writes ``OUT_DIR/result-<rank>.json`` (the world
size of each round it entered)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr
    from tests.restart._arrival_jobs import _wrap_arrive

    rank = int(os.environ["RANK"])
    out = Path(out_dir)

    def hook(session: Any, n: int, phase: str) -> None:
        if n == 0 and phase == "after":
            out.joinpath(f"watcher-{rank}").write_text(str(session.node.watcher_pid))

    _wrap_arrive(hook)
    worlds: list[int] = []

    @tr.Wrapper(
        heartbeat_interval=0.2,
        heartbeat_timeout=2.0,
        soft_timeout=10.0,
        hard_timeout=30.0,
        barrier_timeout=60,
        store_timeout=20,
    )
    def train(call: tr.CallWrapper) -> None:
        worlds.append(call.world_size)
        dist.init_process_group("gloo")
        end = time.monotonic() + 60
        steps = 0
        while time.monotonic() < end and (call.round == 0 or steps < 10):
            t = torch.ones(4)
            dist.all_reduce(t)
            call.ping()
            steps += 1
            time.sleep(0.05)

    train()
    out.joinpath(f"result-{rank}.json").write_text(json.dumps({"worlds": worlds}))


if __name__ == "__main__":
    main(sys.argv[1])
