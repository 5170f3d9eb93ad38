"""The rank function of bench/restart_latency.py (importable by spawned ranks)."""

from __future__ import annotations

import os
import random
import time
from typing import Any


def faulty_training(faults: int, seed: int, world: int) -> dict[str, Any]:
    """Small all_reduce steps; fault ``i`` happens at a random rank and step of round ``i``."""
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr

    rng = random.Random(seed)
    plan = [(rng.randrange(world), rng.randrange(2, 12)) for _ in range(faults)]
    times: dict[str, dict[int, float]] = {"fault": {}, "enter": {}, "init": {}, "first": {}}

    @tr.Wrapper(barrier_timeout=120, completion_timeout=120, max_repeated_faults=None)
    def train(call: tr.CallWrapper) -> int:
        times["enter"][call.round] = time.time()
        dist.init_process_group("gloo")
        times["init"][call.round] = time.time()
        t = torch.ones(64)
        dist.all_reduce(t)
        times["first"][call.round] = time.time()
        for step in range(1, 10_000):
            due = call.round < faults and plan[call.round][1] == step
            if due and plan[call.round][0] % call.world_size == call.rank:
                times["fault"][call.round] = time.time()
                raise RuntimeError("injected")
            if call.round >= faults and step > 5:
                break
            dist.all_reduce(t)
        dist.destroy_process_group()
        return call.round

    rounds = train()
    return {"rank": int(os.environ["RANK"]), "rounds": rounds, "times": times}
