"""This process's progress marks: a ping, a checkpoint saved.

The restart machinery compares the count before and after a round to tell a round that made
progress from one that failed where the previous one failed (see
:mod:`trainguard.restart._repeat`). Marking is one integer increment: call it as often as
you like.
"""

from __future__ import annotations

import itertools

_marks = itertools.count(1)
_last = 0


def mark() -> None:
    """Record that the job made progress (a training step was reported, a checkpoint saved)."""
    global _last
    _last = next(_marks)


def count() -> int:
    """The number of the last mark (0 before any); compare two readings, never subtract."""
    return _last
