"""A worker script for tests/restart/test_torchrun.py, run by the real torchrun.

Usage: ``python -m torch.distributed.run ... _torchrun_worker.py OUT_DIR STEPS``. Each rank
runs a Wrapper-wrapped function with one gloo all_reduce per step; in the first attempt
(``TORCHELASTIC_RESTART_COUNT == "0"``) rank 1 SIGKILLs itself at step 2, so torchrun stops
the other worker and restarts both. Every attempt's ranks write ``done-<attempt>-<rank>``
with the final sum once they finished their steps.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import trainguard.restart as tr


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]

    @tr.Wrapper(store_timeout=10, barrier_timeout=20, completion_timeout=20, heartbeat_timeout=30)
    def train(call: tr.CallWrapper) -> float:
        dist.init_process_group("gloo")
        total = 0.0
        for step in range(steps):
            if attempt == "0" and call.initial_rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.tensor([float(step + call.rank)])
            dist.all_reduce(t)
            total += float(t.item())
        dist.destroy_process_group()
        return total

    total = train()
    (out / f"done-{attempt}-{os.environ['RANK']}").write_text(repr(total))


if __name__ == "__main__":
    main()
