"""A count of the restart rounds aborted in this process, for threads that outlive a round.

The restart wrapper calls :func:`note` when it aborts a round, before it shuts the round's store
connections down. A background thread bound to a round (the local checkpoint pipeline) keeps
the :func:`count` it started with: a different count means its round is over, so a save or a
store call that fails is the abort's doing, not news for the user's log (it goes to the debug
level), and a call on the round's shut connections is not even tried (torch would print its C++
stack trace for it).
"""

from __future__ import annotations

import itertools

__all__ = ["count", "note"]

_counter = itertools.count(1)
_count = 0


def note() -> None:
    """A round of this process was aborted (the restart wrapper's monitor thread)."""
    global _count
    _count = next(_counter)


def count() -> int:
    """How many rounds were aborted in this process so far."""
    return _count
