"""Rank functions of the straggler tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from trainguard import events
from trainguard.stragglers import Stragglers, TakeOutStragglers

# detect_job's phases, in steps (a window is EVERY steps)
EVERY = 8
UNIFORM = range(0, 32)  # every rank's compute takes BASE
SLOWER = range(32, 64)  # every rank's compute takes 2 * BASE: a job uniformly slower
STRAGGLE = range(64, 112)  # rank SLOW's compute takes 2.6 * BASE (30 % over the others)
HANG = 112  # from here no collectives; rank HUNG hangs HANG_S seconds at this step
BASE = 0.010
SLOW, HUNG = 2, 3
HANG_S = 3.0
AFTER_HANG = 150  # steps the others run after HANG (no collectives)


def detect_job(events_dir: str) -> dict[str, Any]:
    """One run, several checks: uniform, uniformly slower, one rank 30 % slower, one hung."""
    events.configure(events_dir)

    @tr.Wrapper(
        stragglers=Stragglers(every=EVERY, threshold=0.87),
        barrier_timeout=60,
        completion_timeout=60,
        soft_timeout=20,
        hard_timeout=30,
    )
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        t = torch.zeros(4)
        for step in range(HANG + AFTER_HANG):
            pause = BASE
            if step in SLOWER or step in STRAGGLE:
                pause = 2 * BASE
            if step in STRAGGLE and call.rank == SLOW:
                pause = 2.6 * BASE
            if step == HANG and call.rank == HUNG:
                events.emit("test_hang", seconds=HANG_S)
                time.sleep(HANG_S)  # a hang: no ping, the others go on
                events.emit("test_hang_end")
                break
            with call.section("compute"):
                time.sleep(pause)
            if step < HANG:
                dist.all_reduce(t)
            call.ping()
        dist.destroy_process_group()
        return call.rank

    rank = train()
    return {"rank": rank, "threads": _our_threads()}


def take_out_job(events_dir: str, steps: int) -> dict[str, Any]:
    """4 processes, 3 active: initial ranks 1 and 2 are twice as slow as rank 0; the policy
    takes at most one rank out per hour. Returns what each round looked like here."""
    events.configure(events_dir)
    seen: list[tuple[int, int]] = []

    @tr.Wrapper(
        stragglers=Stragglers(
            every=6, threshold=0.85, take_out=TakeOutStragglers(windows=2, max_per_hour=1)
        ),
        rank_filter=tr.MaxActiveWorldSize(3),
        rank_assignment=tr.FillGaps(),
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        seen.append((call.round, call.rank))
        t = torch.zeros(4)
        for _ in range(steps):
            with call.section("compute"):
                time.sleep(2 * BASE if call.initial_rank in (1, 2) else BASE)
            dist.all_reduce(t)
            call.ping()
        dist.destroy_process_group()
        return call.rank

    try:
        train()
    except Exception as exc:
        return {"seen": seen, "error": type(exc).__name__, "threads": _our_threads()}
    return {"seen": seen, "error": None, "threads": _our_threads()}


def _our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("trainguard"))
