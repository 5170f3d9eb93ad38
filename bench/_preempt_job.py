"""The rank function of bench/preempt.py: a Wrapper job holding ``mib`` MiB of state per rank.

Each step all-reduces a small tensor (the ranks stay in step, as with DDP) and sleeps
``step_time``. At step ``plain_at`` it times a plain ``AsyncCheckpointer`` save of the whole
state (``save`` + ``wait``: durable and committed), then a local save of it. At every step boundary it calls
``call.preempted(step)``; on True it saves the same state (a local and a durable checkpoint),
waits for both and writes ``OUT/rank-<rank>.json``: the wall times at which the stop was
agreed, the state durable and the local checkpoint saved, and the plain saves' seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr


def job(out: str, *, mib: int, steps: int, plain_at: int, step_time: float) -> None:
    from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    root = Path(out)
    disk = AsyncCheckpointer(commit_timeout=120)
    local = LocalCheckpointManager(root / "local" / f"rank{rank}", timeout=120)
    numel = max(1, mib * 2**20 // 4 // 8)
    state: dict[str, Any] = {f"t{i}": torch.full((numel,), float(i)) for i in range(8)}
    record: dict[str, Any] = {"rank": rank}

    @tr.Wrapper(preemption_grace=120, soft_timeout=60, hard_timeout=120, max_rounds=2)
    def train(call: tr.CallWrapper) -> None:
        dist.init_process_group("gloo")
        for step in range(steps):
            if call.preempted(step):
                record["stop_at"] = time.time()
                record["stop_step"] = step
                disk.save({**state, "step": step}, root / "ckpt" / f"step_{step:06d}")
                local.save({**state, "step": step}, step)
                disk.wait(timeout=call.grace_left())
                record["durable_at"] = time.time()
                local.wait(timeout=call.grace_left())
                record["local_at"] = time.time()
                (root / f"rank-{rank}.json").write_text(json.dumps(record))
                return
            if step == plain_at:
                t0 = time.monotonic()
                disk.save({**state, "step": step}, root / "plain" / f"step_{step:06d}")
                disk.wait()
                record["plain_s"] = time.monotonic() - t0
                t0 = time.monotonic()  # the local checkpoints of a run are warm too
                local.save({**state, "step": step}, step)
                local.wait()
                record["plain_local_s"] = time.monotonic() - t0
                (root / f"ready-{rank}").touch()
            dist.all_reduce(torch.ones(4))
            time.sleep(step_time)

    try:
        train()
    finally:
        local.close()
        disk.close()
