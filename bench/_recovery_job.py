"""Helpers of bench/recovery.py: the job-restart baseline, one part transfer, a memory watch.

- :func:`job_restart`: fresh processes that import torch, init a gloo group, load a checkpoint
  file of the row's state size and finish one all_reduce (what a job-level restart costs at
  least, without the launcher's own time);
- :func:`send_part` (a rank function for ``tests._dist.run_ranks``): rank 0 sends ``nbytes``
  to rank 1 over gloo, the receiver times it: one part transfer of that size;
- :class:`TreeMemory`: the peak resident memory of a process and its descendants, sampled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests._dist import free_port, live_processes

BASELINE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
state = torch.load(sys.argv[1], weights_only=True)
t = torch.ones(64); dist.all_reduce(t)
dist.destroy_process_group()
"""


def write_state(path: Path, nbytes: int) -> Path:
    """A checkpoint file of about ``nbytes`` (one tensor) for the baseline to load."""
    import torch

    torch.save({"state": torch.zeros(max(nbytes, 1) // 4 + 1, dtype=torch.int32)}, path)
    return path


def job_restart(world: int, repeats: int, ckpt: Path) -> list[float]:
    """Seconds from starting ``world`` fresh processes to all of them done (import torch, init
    gloo, load ``ckpt``, one all_reduce), ``repeats`` times."""
    return [_fresh_job(world, ckpt) for _ in range(repeats)]


def _fresh_job(world: int, ckpt: Path) -> float:
    common = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    common["MASTER_PORT"] = str(free_port())
    cmd = [sys.executable, "-c", BASELINE, str(ckpt)]
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, env={**common, "RANK": str(r)}) for r in range(world)]
    if codes := [c for c in (p.wait(timeout=300) for p in procs) if c]:
        raise RuntimeError(f"job-restart baseline processes failed: {codes}")
    return time.monotonic() - start


def send_part(nbytes: int, repeats: int) -> list[float]:
    """Rank 0 sends ``nbytes`` to rank 1 ``repeats`` times (gloo); rank 1 returns each receive's
    seconds (from a barrier to the whole message received), rank 0 an empty list."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        took = []
        for _ in range(repeats):
            dist.barrier()
            start = time.monotonic()
            if dist.get_rank() == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
                took.append(time.monotonic() - start)
        dist.barrier()
        return took
    finally:
        dist.destroy_process_group()


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for pid, fields in live_processes().items():
        tree.setdefault(int(fields[1]), []).append(pid)
    return tree


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class TreeMemory:
    """Samples, every ``interval`` seconds until :meth:`stop`, the summed RSS of ``pid`` and its
    descendants (shared staging memory counts once per process that maps it) and the drop of
    the machine's MemAvailable (other processes' use included)."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.peak_rss = 0
        self.base_available = _available()
        self.min_available = self.base_available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            tree, todo, total = _children(), [self.pid], 0
            while todo:
                pid = todo.pop()
                total += _rss(pid)
                todo += tree.get(pid, [])
            self.peak_rss = max(self.peak_rss, total)
            self.min_available = min(self.min_available, _available())

    def stop(self) -> dict[str, float]:
        """Stop sampling; the peaks in GiB."""
        self._stop.set()
        self._thread.join()
        gib = float(1 << 30)
        drop = self.base_available - self.min_available
        return {"peak_rss_gib": self.peak_rss / gib, "available_drop_gib": drop / gib}
