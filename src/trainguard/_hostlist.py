"""Slurm host lists: ``node[1-2]-ib,a[01-03,07],b5`` to the host names they stand for.

Slurm writes a set of hosts compactly: a comma separates hosts; brackets hold a comma-separated
list of numbers and ranges (``lo-hi``, zero-padded to the width of ``lo``) that expand in
place, and a name may carry several bracket groups and text after them (``rack[1-2]-n[01-02]``
is four hosts, the last group varying fastest). Commas inside brackets do not separate hosts.

:func:`expand` lists every host in order; :func:`first_host` is the first one, without
expanding the rest (a large allocation's list can name tens of thousands of hosts).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from trainguard.errors import ConfigError

__all__ = ["expand", "first_host", "iter_hosts"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' without ']'")
    parts.append(nodelist[start:])
    return parts


def _numbers(group: str) -> list[str]:
    out: list[str] = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise ValueError(f"[{group}] holds {item!r}, not a number or a range")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range {item!r} runs backwards")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(pattern: str) -> Iterator[str]:
    pieces = re.split(r"\[([^\]]*)\]", pattern)  # text, group, text, group, ..., text
    choices = [[piece] if i % 2 == 0 else _numbers(piece) for i, piece in enumerate(pieces)]
    for combo in itertools.product(*choices):
        yield "".join(combo)


def iter_hosts(nodelist: str) -> Iterator[str]:
    """The hosts of ``nodelist`` in order, one at a time. Raises :class:`ConfigError` for a
    list that is not a Slurm host list."""
    try:
        parts = [p.strip() for p in _split_top(nodelist.strip())]
        if not nodelist.strip() or any(not p for p in parts):
            raise ValueError("an empty host name")
        for part in parts:
            for host in _expand_one(part):
                if not host:
                    raise ValueError("an empty host name")
                yield host
    except ValueError as exc:
        raise ConfigError(
            f"cannot read the Slurm node list {nodelist!r} ({exc}); set MASTER_ADDR (or "
            "--rdzv-endpoint) to the first node's address"
        ) from None


def expand(nodelist: str) -> list[str]:
    """Every host of ``nodelist``, in order (``a[01-02],b5`` -> ``a01, a02, b5``)."""
    return list(iter_hosts(nodelist))


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist`` (``node[1-2]-ib`` -> ``node1-ib``)."""
    return next(iter_hosts(nodelist))
