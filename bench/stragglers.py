"""Straggler detection: how soon a slow rank is named, and what measuring costs a tight loop.

1. Detection delay: 4 real ranks (spawned processes, gloo, one ``all_reduce`` per step, the
   Wrapper with ``Stragglers(every=EVERY)``). Each step's ``compute`` section sleeps BASE
   seconds; from step START rank SLOW takes 10 %, 30 % or 100 % longer (one job each). Delay =
   time of its first ``straggler`` event - time it slowed down, also in windows (EVERY steps).
   Each at the default threshold (0.85), and 10 % at 0.95 too. False names (another rank, or before
   START) are counted.
2. Cost: one process, a small training step (Linear 256x256, batch 64: forward, backward,
   SGD) with two sections and the step mark that ``call.ping()`` adds, against the same step
   without them (the baseline), blocks alternated, best block of each (the A/B difference: on
   a shared machine mostly noise); and what the two sections and the mark cost alone (best
   of 10 loops, an empty loop subtracted), as a share of the baseline step: the overhead.

Run: ``.venv/bin/python bench/stragglers.py`` (about a minute).
"""

from __future__ import annotations

import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks

from bench._common import print_table, write_results

EVERY = 10
BASE = 0.01
START = 30
STEPS = START + 12 * EVERY
SLOWDOWNS = (0.10, 0.30, 1.00)
SLOW = 1


def delay_rank(events_dir: str, threshold: float, slowdown: float) -> dict[str, Any]:
    """One rank of the detection-delay job; returns when it slowed down (epoch seconds)."""
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr
    from trainguard import events
    from trainguard.stragglers import Stragglers

    events.configure(events_dir)

    @tr.Wrapper(
        stragglers=Stragglers(every=EVERY, threshold=threshold),
        barrier_timeout=120,
        completion_timeout=120,
        sidecar=False,  # not what is measured; its start-up alone fails on a machine this busy
    )
    def train(call: tr.CallWrapper) -> float:
        dist.init_process_group("gloo")
        t = torch.zeros(1)
        began = 0.0
        for step in range(STEPS):
            if step == START:
                began = time.time()
            slow = step >= START and call.rank == SLOW
            pause = BASE * (1 + slowdown) if slow else BASE
            with call.section("compute"):
                time.sleep(pause)
            dist.all_reduce(t)
            call.ping()
        dist.destroy_process_group()
        return began

    return {"began": train()}


def detection(threshold: float, slowdown: float) -> dict[str, Any]:
    from trainguard.events import read_events

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(delay_rank, 4, args=(tmp, threshold, slowdown), timeout=240)
        began = results[SLOW].get()["began"]
        evs = read_events(tmp)
    named = sorted((e for e in evs if e["kind"] == "straggler"), key=lambda e: e["time"])
    right = [e for e in named if e["rank"] == SLOW and e["time"] >= began]
    delay = right[0]["time"] - began if right else None
    window_s = EVERY * BASE * (1 + slowdown)
    return {
        "threshold": threshold,
        "slowdown_pct": round(100 * slowdown),
        "named": bool(right),
        "delay_s": delay,
        "delay_windows": None if delay is None else delay / window_s,
        "relative": right[0]["relative"] if right else None,
        "false_names": len(named) - len(right),
    }


def cost(blocks: int = 12, steps: int = 400) -> dict[str, float]:
    import torch

    from trainguard.stragglers import _timing, section

    torch.set_num_threads(1)
    net = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    x = torch.randn(64, 256)
    woken: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    timer = _timing.Timer(window=50, every=50, on_window=woken.put, cuda=False)

    def plain() -> None:
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def measured() -> None:
        with section("forward"):
            loss = net(x).square().mean()
        with section("backward"):
            opt.zero_grad()
            loss.backward()
        opt.step()
        timer.step()

    def block(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps

    _timing.use(timer)
    try:
        best = {"plain": float("inf"), "measured": float("inf")}
        for _ in range(blocks):
            best["plain"] = min(best["plain"], block(plain))
            best["measured"] = min(best["measured"], block(measured))
        n = 20_000

        def instrumentation() -> float:  # what one measured step adds, without the step
            start = time.perf_counter()
            for _ in range(n):
                with section("forward"):
                    pass
                with section("backward"):
                    pass
                timer.step()
            return (time.perf_counter() - start) / n

        def empty() -> float:
            start = time.perf_counter()
            for _ in range(n):
                pass
            return (time.perf_counter() - start) / n

        added = min(instrumentation() - empty() for _ in range(10))
    finally:
        _timing.use(None)
    return {
        "step_s": best["plain"],
        "measured_step_s": best["measured"],
        "ab_difference_pct": 100 * (best["measured"] - best["plain"]) / best["plain"],
        "added_us": added * 1e6,
        "overhead_pct": 100 * added / best["plain"],
    }


def main() -> None:
    rows = [detection(0.85, slow) for slow in SLOWDOWNS] + [detection(0.95, SLOWDOWNS[0])]
    print_table(
        f"detection delay (4 ranks, {BASE * 1e3:g} ms compute, window = {EVERY} steps)",
        ["threshold", "slowdown %", "named", "delay s", "delay windows", "score", "false names"],
        [
            [
                r["threshold"],
                r["slowdown_pct"],
                r["named"],
                "-" if r["delay_s"] is None else r["delay_s"],
                "-" if r["delay_windows"] is None else r["delay_windows"],
                "-" if r["relative"] is None else r["relative"],
                r["false_names"],
            ]
            for r in rows
        ],
    )
    c = cost()
    print_table(
        "measurement cost on a tight loop (baseline: the same step unmeasured)",
        ["step (baseline)", "step measured", "A/B %", "2 sections + mark", "overhead %"],
        [
            [
                f"{c['step_s'] * 1e6:.1f} us",
                f"{c['measured_step_s'] * 1e6:.1f} us",
                f"{c['ab_difference_pct']:.2f}",
                f"{c['added_us']:.2f} us",
                f"{c['overhead_pct']:.2f}",
            ]
        ],
    )
    path = write_results("stragglers", {"detection": rows, "cost": c})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
