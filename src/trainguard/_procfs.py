"""A process's line in ``/proc/<pid>/stat`` (Linux), read in one place.

The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
fields are taken after its last ``)``: the state first, then the parent's pid.
"""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``pid``'s stat line after its command name (``[state, ppid, pgrp, ...]``);
    None when it cannot be read (the process is gone, or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields if len(fields) >= 2 else None


def parent_of(pid: int) -> int | None:
    """``pid``'s parent's pid, None when it cannot be read."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def state_of(pid: int) -> str | None:
    """``pid``'s state letter (``R``, ``S``, ``T``: stopped, ``Z``...), None when unreadable."""
    fields = stat_fields(pid)
    return fields[0].decode() if fields is not None else None


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, their children, ...), from one pass over
    ``/proc``; those that exit meanwhile are left out."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (parent := parent_of(int(name))) is not None:
            children.setdefault(parent, []).append(int(name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
