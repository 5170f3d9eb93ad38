"""How much memory a new staging buffer may take, asked before it is reserved.

Reserving more shared memory than the machine (or the job's cgroup) can give ends in the OOM
killer, and mapping more than ``RLIMIT_AS`` allows in an error deep inside torch; neither
names the cause. :func:`check` refuses such a buffer first with a
:class:`~trainguard.errors.CheckpointError` that says which limit and what to do. The numbers
are estimates (memory the kernel could reclaim counts as free), so a buffer that passes can
still fail to be reserved: that failure is turned into the same error by the caller.
"""

from __future__ import annotations

import contextlib
import os
import resource

from trainguard.errors import CheckpointError

_FIX = "save less state per rank, free memory, or raise the limit"


def _fields(path: str) -> dict[str, int]:
    """``name value`` (or ``name: value kB``) lines of a /proc or cgroup file, in bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.replace(":", " ").split()
            if len(parts) >= 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return out


def _read_int(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return int(f.read().strip())
    return None


def _cgroup_room() -> tuple[int, int] | None:
    """``(room, limit)`` of this process's memory cgroup (v2 or v1), or None without a limit."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                base, names = f"/sys/fs/cgroup{path}", ("memory.max", "memory.current")
                cache = ("inactive_file", "active_file")
            elif "memory" in controllers.split(","):
                base = f"/sys/fs/cgroup/memory{path}"
                names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
                cache = ("total_inactive_file", "total_active_file")
            else:
                continue
            limit, used = (_read_int(os.path.join(base, n)) for n in names)
            if limit is None or used is None or limit >= 1 << 60:
                continue
            stat = _fields(os.path.join(base, "memory.stat"))
            return limit - used + sum(stat.get(c, 0) for c in cache), limit
    return None


def check(nbytes: int) -> None:
    """Raise :class:`CheckpointError` when a buffer of ``nbytes`` clearly cannot be reserved."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = _fields("/proc/self/status").get("VmSize", 0)
        if used + nbytes > soft:
            raise CheckpointError(
                f"a staging buffer of {nbytes >> 20} MiB does not fit in this process's "
                f"address-space limit (RLIMIT_AS {soft >> 20} MiB, {used >> 20} MiB in use): "
                f"{_FIX} (ulimit -v)"
            )
    info = _fields("/proc/meminfo")
    if "MemAvailable" in info:
        room = info["MemAvailable"] + info.get("SwapFree", 0)
        if nbytes > room:
            raise CheckpointError(
                f"a staging buffer of {nbytes >> 20} MiB is more than the memory available "
                f"({room >> 20} MiB, swap included): {_FIX}"
            )
    cgroup = _cgroup_room()
    if cgroup is not None and nbytes > cgroup[0]:
        raise CheckpointError(
            f"a staging buffer of {nbytes >> 20} MiB is more than this job's memory cgroup "
            f"has left ({cgroup[0] >> 20} MiB of {cgroup[1] >> 20} MiB): {_FIX}"
        )
