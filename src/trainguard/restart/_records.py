"""The barrier's values read back from the store, their types and shapes checked.

Anyone who can write to the store could leave any bytes under a key, and a rank must never
act on a value it misread: :func:`layout` returns a published round layout or raises
:class:`~trainguard.errors.CoordinationError` saying what is wrong with it, :func:`record`
returns a rank's barrier record or None for one that is unreadable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError, CoordinationError

__all__ = ["layout", "record"]


def _load(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ranks(value: object) -> bool:
    return isinstance(value, list) and all(_is_rank(r) for r in value)


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
_LAYOUT: dict[str, _Check] = {
    "round": _is_int,
    "active": _ranks,
    "spare": _ranks,
    "gone": _why_by_rank,
    "faults": _why_by_rank,
    "pg": _pg,
    "end": _optional_str,
}


def layout(raw: bytes | str) -> dict[str, Any]:
    """A round layout as :class:`~trainguard.restart._book.RoundBook` publishes it."""
    doc = _load(raw)
    if isinstance(doc, dict):
        bad = [name for name, ok in _LAYOUT.items() if not ok(doc.get(name))]
        if not bad:
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
