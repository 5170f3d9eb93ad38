"""Carrying out one soak fault inside the rank process that it targets.

The faults the demo knows (exception, hang, kill, lostdir) go through
:func:`trainguard.demo.faults.inject`; the others are done here: SIGKILL of one of this
process's helper processes (found as its children in ``/proc``), and filling the disk
checkpoint file system. Every injection appends one JSON line to ``faults.jsonl`` in the run
directory before it acts (one ``write`` on an ``O_APPEND`` file, so lines never interleave).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from bench._soak_plan import FILLER, PlannedFault, SoakConfig
from trainguard.demo import faults as demo_faults

SIDECAR_MODULE = "trainguard.restart.sidecar"
SPAWN_CHILD = "multiprocessing.spawn"  # how a spawn-context child (a writer) shows in its argv


def children(pid: int) -> list[int]:
    """pids whose parent is ``pid`` (scans ``/proc/*/stat``; needs no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def find_watcher() -> int | None:
    """This job's node watcher: detached (no rank is its parent), it holds the environment of
    the rank that started it, this segment's ``TRAINGUARD_JOB_ID`` among it."""
    job = f"TRAINGUARD_JOB_ID={os.environ['TRAINGUARD_JOB_ID']}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or SIDECAR_MODULE not in cmdline(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if job in f.read().split(b"\0"):
                    return int(entry)
        except OSError:
            continue
    return None


def find_writer(which: str, disk_writer: int | None) -> int | None:
    """The disk checkpointer's writer (its public ``writer_pid``) or the local manager's (the
    other spawn child of this process)."""
    if which == "disk":
        return disk_writer
    for pid in children(os.getpid()):
        if pid != disk_writer and SPAWN_CHILD in cmdline(pid):
            return pid
    return None


def record(cfg: SoakConfig, fault: PlannedFault, **fields: Any) -> None:
    line = json.dumps({"label": fault.label, "kind": fault.kind, **fields}) + "\n"
    fd = os.open(Path(cfg.out) / "faults.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def fill_disk(root: str) -> int:
    """Fill the file system of ``root`` up to the last block; returns the bytes taken."""
    free_disk(root)  # an earlier fill that no restart cleaned up yet
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    fd = os.open(Path(root) / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    taken = 0
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, free)
            taken = free
        os.lseek(fd, 0, os.SEEK_END)
        for size in (1 << 16, 4096):  # what fallocate left (all of it, where unsupported)
            with contextlib.suppress(OSError):
                while True:
                    taken += os.write(fd, bytes(size))
    finally:
        os.close(fd)
    return taken


def free_disk(root: str) -> bool:
    """Remove the filler; True if there was one."""
    try:
        os.unlink(Path(root) / FILLER)
    except FileNotFoundError:
        return False
    return True


def inject(
    cfg: SoakConfig,
    fault: PlannedFault,
    context: dict[str, Any],
    *,
    disk_writer: int | None,
    local_root: Path,
) -> None:
    """Carry out ``fault`` (already claimed) in this process; ``context`` goes to the log."""
    base = {"time": time.time(), **context}
    kind = fault.kind
    if kind in ("writer", "watcher"):
        pid = find_watcher() if kind == "watcher" else find_writer(fault.detail, disk_writer)
        record(cfg, fault, **base, target_pid=pid, injected=pid is not None)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return
    if kind == "diskfull":
        taken = fill_disk(cfg.disk)
        record(cfg, fault, **base, filled_bytes=taken, injected=taken > 0)
        return
    record(cfg, fault, **base, injected=True)
    if kind == "lostdir":
        shutil.rmtree(local_root, ignore_errors=True)
    demo_faults.inject(demo_faults.Fault(fault.step, fault.rank, kind))
