"""Record a few events the way trainguard does, then read them back merged.

Run: .venv/bin/python examples/event_log.py [RUN_DIR]
"""

from __future__ import annotations

import sys
import tempfile
import time

from trainguard import events


def main() -> None:
    run_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="trainguard-events-")
    log = events.configure(run_dir, rank=0)
    log.set_context(round=0)
    events.emit("fault", cause="ValueError: injected")
    with events.span("abort") as extra:
        time.sleep(0.002)
        extra["sockets"] = 2
    log.set_context(round=1)
    events.emit("restart")
    events.configure(None)  # close the file
    for event in events.read_events(run_dir):
        print(event["kind"], event["round"], event.get("duration"))
    print(f"events in {run_dir}; print them with: trainguard events {run_dir}")


if __name__ == "__main__":
    main()
