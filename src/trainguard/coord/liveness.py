"""A liveness ring's member: it beats a counter of its own and reads the next members'.

The node ring (:class:`trainguard.coord.node_ring.NodeRing`, one member per node, of the
launcher's agents and of the node watchers alike) runs on this module's beat, read, clocks and
starvation rule; what it reads is judged by :func:`trainguard.coord.ring_judge.judge`, and the
ring's protocol is written in :mod:`trainguard.coord.node_ring`.

Keys (the user names them, :attr:`RingWatch.key`): one per member, for example
``trainguard/launch/<run_id>/g<gen>/node/<node>``. A key holds the member's own ``prefix``
followed by its counter in decimal digits (``blank`` until its first beat), or ``bye`` once the
member ended normally; a user may give other values a meaning of its own (the agents' lost
mark).

One interval of one member, two store operations:

1. **Beat** (:meth:`RingWatch.beat`): count the own counter up and write it, with ``set`` (what
   another writer left there is overwritten) or, ``guarded``, with ``compare_set`` from the
   member's own last value, so that a mark another member wrote over it is found (the beat then
   returns that value and writes nothing).
2. **Read** (:meth:`RingWatch.read`): the keys of the members that follow this one in ring order
   (ascending, wrapping around: :func:`ring_after`), at most ``window`` of them, in one
   ``multi_get``. Each key is made to exist once first (``compare_set`` from ``""`` to
   ``blank``: never ``add``, a TCPStore server drops the connection of an ``add`` to a value that
   is no number), so that reading never blocks on a missing key.
3. **Judge** on this process's monotonic clock (:meth:`RingWatch.clock`): a member whose value
   did not change for ``timeout`` is silent.
4. **Restart the clocks when starved**: if this watcher's previous look is longer ago than
   ``max(timeout / 2, 2 * interval)`` (the store did not answer, or this process got no CPU or
   was stopped), that time says nothing about the others: every clock starts afresh instead of
   declaring everyone silent at once.

Store traffic: O(N) in all per interval (each key read by about ``window`` watchers), never
every member reading every other member's key. :meth:`RingWatch.run` drives the intervals on
the real monotonic clock: a beat every ``interval`` and, with :attr:`RingWatch.due` set by the
look, a look between beats at the moment an observed member would be late.

No torch here: the node watcher's process imports this module (it talks to the store through
:mod:`trainguard.coord._wire`).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

from trainguard.coord.store import StoreLike

__all__ = ["BYE", "MAX_DIGITS", "Clock", "RingWatch", "clock_after", "ring_after"]

logger = logging.getLogger(__name__)

#: the value of a member that ended normally: it is never judged again
BYE = b"bye"
#: the most digits a heartbeat counter has (a beat every millisecond for a billion years has 20;
#: Python refuses to read an int of more than 4,300 digits)
MAX_DIGITS = 20


#: one member's clock: what it showed, and when (this process's monotonic clock) that last changed
Clock = tuple[Hashable, float]


def clock_after(previous: Clock | None, reading: Hashable, now: float) -> tuple[Clock, float]:
    """A member's clock after it showed ``reading`` at ``now`` (``previous``: its clock before,
    None: not seen yet), and how long it has shown that reading: 0.0 when it changed or is
    seen for the first time (its clock starts)."""
    if previous is None or previous[0] != reading:
        return (reading, now), 0.0
    return previous, now - previous[1]


def ring_after(me: int, members: Iterable[int]) -> list[int]:
    """``members`` (``me`` left out) in ring order after ``me``: ascending from the first one
    above ``me``, wrapping around to the smallest."""
    ring = sorted(m for m in members if m != me)
    start = bisect.bisect_right(ring, me)
    return ring[start:] + ring[:start]


class RingWatch:
    """One member's beat and its watch over the next members of the ring (module docstring).

    Args:
        store: the store client the beats and reads use (:attr:`store`; a user that connects
            afresh replaces it).
        key: the key of a member.
        me: this member.
        interval: seconds between beats.
        timeout: a member whose value did not move for this long by this process's clock is
            silent.
        window: how many members after this one it observes.
        name: what a member is, for the log ("node").
        blank: the value a key is created with before its member's first beat (or the value
            of a member: a function of it).
        prefix: what this member writes before its counter (guarded: unique to this writer).
        guarded: beat with ``compare_set`` from the own last value (see :meth:`beat`).
        clock: monotonic clock in seconds (tests give a fake one).
    """

    def __init__(
        self,
        store: StoreLike,
        key: Callable[[int], str],
        *,
        me: int,
        interval: float,
        timeout: float,
        window: int,
        name: str = "member",
        blank: bytes | Callable[[int], bytes] = b"0",
        prefix: bytes = b"",
        guarded: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.key, self.me, self.name = key, me, name
        self.interval, self.timeout, self.window = interval, timeout, window
        self.blank, self.prefix, self.guarded = blank, prefix, guarded
        self.clock_fn = clock
        self.sent = 0  # this member's counter
        #: this member's last value written (None before its first beat)
        self.mine: bytes | None = None
        #: the observed members' clocks: member -> (what it showed, when that last changed)
        self.seen: dict[int, Clock] = {}
        #: members this watcher saw gone (ended or declared); a look skips them
        self.gone: set[int] = set()
        #: when an observed member is late unless it moves (set by a look)
        self.due: float | None = None
        self.last_look: float | None = None  # when the previous look started
        self.ensured: set[int] = set()  # members whose key exists (reading never blocks)

    # the beat ----------------------------------------------------------------------------
    def beat(self) -> bytes | None:
        """Write this member's next value; None when written. ``guarded``: from its own last
        value only; a value found in its place that an earlier beat of this writer left (its
        call failed after it landed) is overwritten too; any other is returned, unchanged."""
        self.sent += 1
        value = self.prefix + str(self.sent).encode()
        if not self.guarded or self.mine is None:  # the first guarded beat overwrites on purpose
            self.store.set(self.key(self.me), value)
        else:
            got = bytes(self.store.compare_set(self.key(self.me), self.mine, value))
            if got != value and got.startswith(self.prefix):
                got = bytes(self.store.compare_set(self.key(self.me), got, value))
            if got != value:
                return got
        self.mine = value
        return None

    # reading -----------------------------------------------------------------------------
    def ensure(self, members: Iterable[int]) -> None:
        """Make the keys of ``members`` exist (``compare_set`` from ``""``: a missing key only)."""
        for m in members:
            if m not in self.ensured:
                blank = self.blank(m) if callable(self.blank) else self.blank
                self.store.compare_set(self.key(m), "", blank)
                self.ensured.add(m)

    def read(self, members: Sequence[int]) -> tuple[list[bytes], float]:
        """The values of ``members`` (one ``multi_get``) and when they were read."""
        self.ensure(members)
        values = [bytes(v) for v in self.store.multi_get([self.key(m) for m in members])]
        return values, self.clock_fn()

    # the clocks --------------------------------------------------------------------------
    def restart_clocks(self, asked: float, now: float) -> bool:
        """A look that started at ``asked`` read its values at ``now``: if the previous look
        started more than ``max(timeout / 2, 2 * interval)`` before ``now``, this watcher was
        starved and every clock starts afresh (True)."""
        quiet = max(self.timeout / 2, 2 * self.interval)
        starved = self.last_look is not None and now - self.last_look > quiet
        if starved:
            self.seen.clear()
        self.last_look = asked
        return starved

    def clock(self, member: int, reading: Hashable, now: float) -> float:
        """Seconds ``member`` has shown ``reading`` by this process's clock at ``now``; 0.0
        when it changed (or is seen for the first time): its clock starts."""
        self.seen[member], silent = clock_after(self.seen.get(member), reading, now)
        return silent

    def forget(self, member: int) -> None:
        """Drop ``member``'s clock (it went; should it come back it starts afresh)."""
        self.seen.pop(member, None)

    def deadline(self) -> float | None:
        """The earliest moment an observed member is late unless it moves."""
        first = min((t for _, t in self.seen.values()), default=None)
        return None if first is None else first + self.timeout

    # the intervals -----------------------------------------------------------------------
    def beat_and_look(self) -> bool:
        """One interval: this member's beat, then its look (the ring's own, which sets
        :attr:`due`); False when there are no more beats."""
        raise NotImplementedError

    def look(self) -> None:
        """Read the observed members and judge them (the ring's own); sets :attr:`due`."""
        raise NotImplementedError

    def wake(self, next_beat: float) -> float:
        """When there is something to do: the next beat, or before it :attr:`due`."""
        return next_beat if self.due is None else min(next_beat, self.due)

    def step(
        self,
        next_beat: float,
        beat: Callable[[], bool] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> float | None:
        """What is due now: ``beat`` (default :meth:`beat_and_look`) once ``next_beat`` is
        reached, else a :meth:`look` once :attr:`due` is. Returns the next beat's time, None
        when ``beat`` returned False (no more beats). A failure goes to ``on_error`` (default:
        :meth:`failed`), and no deadline is looked at again before the next beat."""
        now = time.monotonic()
        try:
            if now >= next_beat:
                next_beat = max(next_beat + self.interval, now)
                if not (beat or self.beat_and_look)():
                    return None
            elif self.due is not None and now >= self.due:
                self.look()
        except Exception as exc:
            self.due = None
            (on_error or self.failed)(exc)
        return next_beat

    def failed(self, exc: Exception) -> None:
        """A beat or a look failed (the store did not answer): logged; the next beat tries
        again."""
        logger.warning("heartbeat failed: %s", exc)

    def run(
        self,
        stop: threading.Event,
        *,
        first: float | None = None,
        beat: Callable[[], bool] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Beat every ``interval`` from ``first`` (default now) until ``stop`` is set or
        ``beat`` returns False (see :meth:`step`)."""
        next_beat: float | None = time.monotonic() if first is None else first
        while next_beat is not None and not stop.wait(
            max(0.0, self.wake(next_beat) - time.monotonic())
        ):
            next_beat = self.step(next_beat, beat, on_error)
