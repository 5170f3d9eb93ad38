"""Straggler detection: how soon a slow rank is named, and what measuring costs a tight loop.

1. Detection delay: 4 real ranks (spawned processes, gloo, one ``all_reduce`` per step, the
   Wrapper with ``Stragglers(every=EVERY)``). Each step's ``compute`` section sleeps BASE
   seconds; from step START rank 1 takes 10 % longer, rank 2 30 %, rank 3 100 % (rank 0 is the
   fastest). Delay = time of the rank's first ``straggler`` event - time it slowed down, also in
   windows (EVERY steps). Run at the default threshold (0.85) and at 0.95. False names (rank 0,
   or before START) are counted.
2. Cost: one process, a small training step (Linear 256x256, batch 64: forward, backward,
   SGD) with two sections and the step mark that ``call.ping()`` adds, against the same step
   without them (the baseline), blocks alternated, best block of each; and the cost of one
   empty section.

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
SLOWDOWN = {0: 0.0, 1: 0.10, 2: 0.30, 3: 1.00}


def delay_rank(events_dir: str, threshold: float) -> dict[str, Any]:
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
    )
    def train(call: tr.CallWrapper) -> float:
        dist.init_process_group("gloo")
        t = torch.zeros(1)
        began = 0.0
        for step in range(STEPS):
            if step == START:
                began = time.time()
            pause = BASE * (1 + SLOWDOWN[call.rank]) if step >= START else BASE
            with call.section("compute"):
                time.sleep(pause)
            dist.all_reduce(t)
            call.ping()
        dist.destroy_process_group()
        return began

    return {"began": train()}


def detection(threshold: float) -> list[dict[str, Any]]:
    from trainguard.events import read_events

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(delay_rank, 4, args=(tmp, threshold), timeout=240)
        began = {r.rank: r.get()["began"] for r in results}
        evs = read_events(tmp)
    named = [e for e in evs if e["kind"] == "straggler"]
    rows = []
    for rank, slow in SLOWDOWN.items():
        mine = sorted((e for e in named if e["rank"] == rank), key=lambda e: e["time"])
        early = [e for e in mine if e["time"] < began[rank]]
        late = [e for e in mine if e["time"] >= began[rank]]
        delay = late[0]["time"] - began[rank] if late and slow > 0 else None
        window_s = EVERY * BASE * (1 + slow)
        rows.append(
            {
                "threshold": threshold,
                "rank": rank,
                "slowdown_pct": round(100 * slow),
                "named": bool(late) and slow > 0,
                "delay_s": delay,
                "delay_windows": None if delay is None else delay / window_s,
                "relative": late[0]["relative"] if late else None,
                "false_names": len(early) + (len(late) if slow == 0 else 0),
            }
        )
    return rows


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
        n = 100_000
        start = time.perf_counter()
        for _ in range(n):
            with section("empty"):
                pass
        empty = (time.perf_counter() - start) / n
    finally:
        _timing.use(None)
    return {
        "step_s": best["plain"],
        "measured_step_s": best["measured"],
        "overhead_pct": 100 * (best["measured"] - best["plain"]) / best["plain"],
        "section_us": empty * 1e6,
    }


def main() -> None:
    rows = detection(0.85) + detection(0.95)
    print_table(
        f"detection delay (4 ranks, {BASE * 1e3:g} ms compute, window = {EVERY} steps)",
        ["threshold", "rank", "slowdown %", "named", "delay s", "delay windows", "score", "false"],
        [
            [
                r["threshold"],
                r["rank"],
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
        ["step (baseline)", "step (2 sections + step mark)", "overhead %", "one section"],
        [
            [
                f"{c['step_s'] * 1e6:.1f} us",
                f"{c['measured_step_s'] * 1e6:.1f} us",
                f"{c['overhead_pct']:.2f}",
                f"{c['section_us']:.2f} us",
            ]
        ],
    )
    path = write_results("stragglers", {"detection": rows, "cost": c})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
