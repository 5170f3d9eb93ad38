"""Heartbeat values as a watch reads them from the store: :func:`read_counter` and the
warning about a value that is no counter (:func:`log_bad_counter`).

A rank's heartbeat key holds its counter as decimal digits (``b"0"`` until its first beat),
or ``b"bye"`` once it finished normally (the caller checks for that first). Anything else
counts as a counter that does not move.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("trainguard.restart.sidecar")

#: the most digits a heartbeat counter has (a beat every millisecond for a billion years has 20;
#: Python refuses to read an int of more than 4,300 digits)
MAX_DIGITS = 20


def log_bad_counter(r: int, raw: bytes) -> None:
    why = f"no counter ({len(raw)} bytes: {raw[:40]!r})"
    logger.warning(
        "rank %d's heartbeat in the store is %s: judged as silent unless it moves", r, why
    )


def read_counter(raw: bytes) -> int:
    """A heartbeat counter read from the store: 0 for none yet, -1 for a value that is no
    counter (not digits, or more than :data:`MAX_DIGITS` of them)."""
    if not raw:
        return 0
    return int(raw) if len(raw) <= MAX_DIGITS and raw.isdigit() else -1
