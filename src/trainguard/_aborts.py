"""A count of the restart rounds aborted in this process, for threads that outlive a round.

The restart wrapper calls :func:`note` when it aborts a round, before it shuts the round's store
connections down. A background thread bound to a round (the local checkpoint pipeline) keeps
the :func:`count` it started with: a different count means its round is over, so a save or a
store call that fails is the abort's doing, not news for the user's log (it goes to the debug
level).

Such a thread talks to the store through :func:`bound`: a call is refused (:class:`RoundOver`)
once the round is over, and :func:`note` waits a little for the calls in flight to end before it
returns, so that the shutdown never cuts one (torch prints its C++ stack trace for a call whose
connection is shut under it). Only calls that never wait go through it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, TypeVar, cast

__all__ = ["RoundOver", "bound", "count", "note"]

#: how long :func:`note` waits for bound calls in flight (they never wait on the store; one
#: to a store whose host died is cut after this)
IN_FLIGHT_WAIT_S = 0.5

_S = TypeVar("_S")

_counter = itertools.count(1)
_count = 0
_in_flight = 0
_cond = threading.Condition()


class RoundOver(Exception):
    """A store call of a thread bound to a round that was aborted: never sent."""


def note(*, wait: float = IN_FLIGHT_WAIT_S) -> None:
    """A round of this process was aborted (the restart wrapper's monitor thread). Returns
    once no bound call is in flight, or after ``wait`` seconds."""
    global _count
    with _cond:
        _count = next(_counter)
        deadline = time.monotonic() + wait
        while _in_flight and (left := deadline - time.monotonic()) > 0:
            _cond.wait(left)


def count() -> int:
    """How many rounds were aborted in this process so far."""
    return _count


class _Bound:
    """``store`` for a thread bound to the round whose abort count was ``n``."""

    def __init__(self, store: object, n: int) -> None:
        self._store = store
        self._n = n

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method
        n = self._n

        def call(*args: Any, **kwargs: Any) -> Any:
            global _in_flight
            with _cond:
                if _count != n:
                    raise RoundOver(f"store.{name}: the round was aborted; not sent")
                _in_flight += 1
            try:
                return method(*args, **kwargs)
            finally:
                with _cond:
                    _in_flight -= 1
                    _cond.notify_all()

        return call


def bound(store: _S, n: int) -> _S:
    """``store``, whose calls are refused once the round of abort count ``n`` is over and are
    waited for by :func:`note` while in flight. For calls that never wait (``get``, ``set``,
    ``add``, ``check``, ``compare_set``, ``delete_key``): a :func:`note` waits for a blocked
    ``wait`` only ``IN_FLIGHT_WAIT_S``."""
    return cast(_S, _Bound(store, n))
