"""The watchdog's soft timeout: a function that pings is making progress even where the main
thread's frame does not move (a step that waits at one place most of its time)."""

from __future__ import annotations

import time

import trainguard.restart as tr
from tests._dist import run_ranks


def waiting_steps_job(steps: int, step_time: float, ping: bool) -> dict[str, int]:
    """Each step waits ``step_time`` at one line (GIL released), then pings when ``ping``."""

    @tr.Wrapper(
        barrier_timeout=60,
        completion_timeout=60,
        soft_timeout=1.0,
        heartbeat_interval=0.25,
        sidecar=False,
    )
    def train(call: tr.CallWrapper) -> dict[str, int]:
        if call.round > 0:
            return {"round": call.round}
        for _ in range(steps):
            time.sleep(step_time)
            if ping:
                call.ping()
        return {"round": call.round}

    return train()


def test_a_pinging_function_that_waits_in_one_place_is_not_a_hang() -> None:
    # 4 s of steps, each 0.2 s asleep at one line: 4 soft timeouts with the frame unmoved
    (res,) = [r.get() for r in run_ranks(waiting_steps_job, 1, args=(20, 0.2, True), timeout=90)]
    assert res == {"round": 0}


def test_a_function_that_neither_moves_nor_pings_is_a_hang() -> None:
    (res,) = [r.get() for r in run_ranks(waiting_steps_job, 1, args=(20, 0.2, False), timeout=90)]
    assert res == {"round": 1}
