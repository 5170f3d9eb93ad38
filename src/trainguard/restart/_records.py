"""The barrier's values read back from the store, their types and shapes checked.

Anyone who can write to the store could leave any bytes under a key, and a rank must never
act on a value it misread: :func:`layout` returns a published round layout or raises
:class:`~trainguard.errors.CoordinationError` saying what is wrong with it, :func:`record`
returns a rank's barrier record or None for one that is unreadable.

A layout's rank lists (``active``, ``spare``) travel as runs (:func:`runs`): a rank ``r`` or a
pair ``[a, b]`` for the ranks ``a..b`` in that order, so that the usual layout (ranks in order,
a few gone) costs bytes in the number of gaps, not in the number of ranks: every rank reads the
whole layout each round, and at thousands of ranks a list of every rank would be most of the
store's traffic. :func:`layout` expands them back into plain lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError, CoordinationError

__all__ = ["layout", "record", "runs"]

_MAX_RANKS = 1 << 22  # a run list that expands to more ranks than this is not a layout


def _load(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def runs(ranks: list[int] | tuple[int, ...]) -> list[int | list[int]]:
    """``ranks`` as runs: each maximal ascending step-1 stretch of 3 or more ranks becomes
    ``[first, last]``, the other ranks stay as they are (inverse: :func:`_expand`)."""
    out: list[int | list[int]] = []
    i, n = 0, len(ranks)
    while i < n:
        j = i
        while j + 1 < n and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([ranks[i], ranks[j]])
        else:
            out.extend(ranks[i : j + 1])
        i = j + 1
    return out


def _expand(value: object) -> list[int] | None:
    """A run list (see :func:`runs`) as the ranks it stands for; None when it is not one."""
    if not isinstance(value, list):
        return None
    out: list[int] = []
    for item in value:
        if _is_rank(item):
            out.append(item)
            continue
        if not (
            isinstance(item, list)
            and len(item) == 2
            and _is_rank(item[0])
            and _is_rank(item[1])
            and item[0] <= item[1]
            and len(out) + item[1] - item[0] < _MAX_RANKS
        ):
            return None
        out.extend(range(item[0], item[1] + 1))
    return out if len(out) <= _MAX_RANKS else None


def _why_by_rank(value: object) -> bool:
    return isinstance(value, dict) and all(
        k.isdigit() and isinstance(v, str) for k, v in value.items()
    )


def _pg(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return value == "" or bool(parse_addr(value))
    except ConfigError:
        return False


def _optional_str(value: object) -> bool:
    return value is None or isinstance(value, str)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_rank(value: object) -> bool:
    return _is_int(value) and isinstance(value, int) and value >= 0


_Check = Callable[[object], bool]
_RANK_LISTS = ("active", "spare")  # run lists (see :func:`runs`), checked by expanding them
_LAYOUT: dict[str, _Check] = {
    "round": _is_int,
    "gone": _why_by_rank,
    "faults": _why_by_rank,
    "pg": _pg,
    "end": _optional_str,
}


def layout(raw: bytes | str) -> dict[str, Any]:
    """A round layout as :class:`~trainguard.restart._book.RoundBook` publishes it."""
    doc = _load(raw)
    if isinstance(doc, dict):
        # every rank reads the layout each round: expand each rank list once (the check is
        # the expansion itself)
        expanded = {name: _expand(doc.get(name)) for name in _RANK_LISTS}
        bad = [name for name, ok in _LAYOUT.items() if not ok(doc.get(name))]
        bad[:0] = [name for name, ranks in expanded.items() if ranks is None]
        if not bad:
            doc.update(expanded)
            return doc
        problem = "bad " + ", ".join(bad)
    else:
        problem = "not a JSON object"
    text = raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")
    raise CoordinationError(
        f"unreadable round layout in the store ({problem}): {text[:200]!r}; something other "
        "than this job wrote it: give each job its own store (MASTER_PORT) and set "
        "TRAINGUARD_JOB_SECRET"
    )


_RECORD: dict[str, _Check] = {
    "r": _is_rank,
    "host": _is_str,
    "local_rank": _is_int,
    "leave": _optional_str,
    "fault": _optional_str,
}


def record(raw: bytes | str) -> dict[str, Any] | None:
    """A rank's barrier record (see :meth:`RoundBook.record`); None when it is not one."""
    doc = _load(raw)
    if isinstance(doc, dict) and all(ok(doc.get(name)) for name, ok in _RECORD.items()):
        return doc
    return None
