"""Cost of one event: disabled log, enabled log, against a plain buffered json write.

Baseline: ``f.write(json.dumps(event) + "\\n")`` on a buffered file, which is not safe against a
process killed mid-line nor against threads interleaving, but is the cheapest way to write JSON
lines at all. Run: ``.venv/bin/python bench/events_overhead.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import print_table, write_results
from trainguard.events import EventLog

N = 50_000


def per_call(fn) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(N):
            fn(i)
        best = min(best, (time.perf_counter() - start) / N)
    return best


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        disabled = EventLog(None)
        enabled = EventLog(Path(tmp) / "events", rank=0)
        with open(Path(tmp) / "plain.jsonl", "w") as f:
            rows = {
                "disabled emit": per_call(lambda i: disabled.emit("tick", step=i)),
                "enabled emit (os.write per line)": per_call(
                    lambda i: enabled.emit("tick", step=i)
                ),
                "baseline: buffered json.dumps + write": per_call(
                    lambda i: f.write(
                        json.dumps({"time": time.time(), "kind": "tick", "step": i}) + "\n"
                    )
                ),
            }
        enabled.close()
    print_table(
        f"event log cost per call (best of 3 x {N})",
        ["variant", "us/call"],
        [[k, v * 1e6] for k, v in rows.items()],
    )
    write_results("events_overhead", {k: {"seconds_per_call": v} for k, v in rows.items()})


if __name__ == "__main__":
    main()
