"""Newcomers: a process that joins a running job at a round boundary.

A newcomer is a process of an initial rank that already took part in the job: a launcher's
respawn of a dead rank (``TRAINGUARD_INCARNATION`` > 0), or any process whose rank the job
counts as gone. It knows the job secret like any rank (:class:`~._session.Session`), then,
instead of round 0's barrier (:class:`Newcomer`):

1. It reads :attr:`Keyspace.latest`: the layout of the latest published round ``L`` (none:
   the job is still at round 0's barrier). Round ``m = L + 1`` is the next barrier.
2. Still in the roster of ``m`` (a death notice written with ``returning=True`` kept it
   there, and round ``m``'s barrier waits for it): it arrives like any rank.
3. Otherwise it writes its record for round ``m`` without counting itself (it is not in the
   roster). The layout writer of round ``m`` admits it (:meth:`RoundBook._admit`). When
   admitting it would make the active world larger (the rank assignment and filter say so),
   it ends round ``L`` with an ``admit`` outcome, so the others restart and come to round
   ``m``'s barrier at once; else it waits for the round to end on its own (a fault).
4. Round ``m`` published without it (its record came too late, or a notice had written its
   departure there first): it tries round ``m + 1`` (its line in round ``m``'s pool, read by
   nobody now, goes with that round's keys). A round that ends
   the job ends its wait too: it returns without having run (``complete``) or raises
   :class:`~trainguard.errors.JobEndedError` (``end``).

Events: ``join_wait`` (waiting_round, admit) each time it waits outside the roster;
``launch_admitted`` once it enters its first round (:meth:`Session.join`).

Waiting is woken by the store: a ``wait`` on the running round's outcome (in slices of
:data:`_SLICE` seconds, between which it looks whether the next round was published or the
job's keys were deleted), then on the next round's layout. Round ``m``'s publisher deletes
round ``L``'s keys: a newcomer that looks at ``L``'s outcome only after that (woken, then not
scheduled while the others restarted) reads round ``m``'s layout instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from trainguard import events
from trainguard.coord import barrier
from trainguard.errors import JobEndedError
from trainguard.restart import _records
from trainguard.restart._book import RoundBook, peek
from trainguard.restart._records import BarrierRecord, RoundLayout
from trainguard.restart.policy.layout import Layout
from trainguard.restart.state import RoundOutcome

__all__ = ["Newcomer"]

logger = logging.getLogger(__name__)

_SLICE = 2.0  # seconds between two looks at whether the job ended (its keys deleted)

#: ``(round, roster)``: tells the rank's sidecar the round whose next barrier it waits at.
Notify = Callable[[int, Sequence[int]], None]


class Newcomer:
    """One newcomer's way into the running job (see the module docstring).

    Args:
        book: this rank's round book (its roster and ``gone`` are set from the rounds read).
        record: this rank's barrier record (``r``, ``host``, ``local_rank`` ...).
        barrier_timeout: the longest wait at a barrier whose roster holds this rank.
        notify: called before each wait outside the roster (the sidecar learns the round).
    """

    def __init__(
        self,
        book: RoundBook,
        record: BarrierRecord,
        *,
        barrier_timeout: float,
        notify: Notify | None = None,
    ) -> None:
        self.book = book
        self.store = book.store
        self.keys = book.keys
        self.rank = record.rank
        self.record = record
        self.barrier_timeout = barrier_timeout
        self.notify = notify

    def join(self) -> tuple[int, RoundLayout] | None:
        """The first round this rank is laid out in and its layout; None when the job
        completed first. Raises :class:`JobEndedError` when it ended with an error."""
        if self.store.check([self.keys.ended]):
            return None  # it came after the job ended and its keys were deleted
        raw = peek(self.store, self.keys.latest)
        current = _records.layout(raw) if raw is not None else None
        while True:
            if current is not None:
                self.book.enter(current)
            m = current.round + 1 if current is not None else 0
            self.book.record(m, self.record)
            if self.rank in self.book.roster:
                return m, self._arrive(m)
            self._ask(m, current)
            ready = self._wait(m)
            if ready is None:
                return None
            if ready.holds(self.rank):
                return m, ready
            logger.info("rank %d: not admitted in round %d; trying the next", self.rank, m)
            current = ready

    def _arrive(self, m: int) -> RoundLayout:
        """In the roster of round ``m``: arrive and wait like any rank."""
        raw = self.book.arrive(m)
        if raw is None:
            raw = barrier.wait_key(
                self.store, self.keys.ready(m), self.barrier_timeout, what=f"round {m} barrier"
            )
        return _records.layout(raw)

    def _ask(self, m: int, current: RoundLayout | None) -> None:
        """Waiting outside the roster of round ``m``: tell the sidecar; end the running round
        with an ``admit`` outcome when this rank would make the active world larger."""
        if self.notify is not None:
            self.notify(m - 1, self.book.roster)
        admit = current is not None and not current.end and self._grows(m, current)
        events.emit("join_wait", waiting_round=m, admit=admit)
        if admit and peek(self.store, self.keys.ready(m)) is None:  # not published meanwhile
            self.book.propose(m - 1, RoundOutcome.admit(self.rank))

    def _grows(self, m: int, current: RoundLayout) -> bool:
        """Would the rank assignment and filter make more ranks active with this one?"""
        roster = current.roster
        layout = Layout.start(
            round=m,
            initial_world_size=self.book.world,
            previous=roster,
            present=set(roster) | {self.rank},
        )
        policies = self.book.policies
        try:
            layout = policies.rank_assignment(layout)
            if policies.rank_filter is not None:
                layout = policies.rank_filter(layout)
        except Exception as exc:  # a policy that needs facts of every rank (GroupedByKey)
            logger.debug("cannot tell whether rank %d grows the world: %s", self.rank, exc)
            return not current.spare
        return len(layout.active) > len(current.active)

    def _wait(self, m: int) -> RoundLayout | None:
        """Round ``m``'s layout once published; None when the job completed before (round
        ``m - 1`` complete, or its keys already deleted). Woken by the store: first by round
        ``m - 1``'s outcome (a newcomer may wait as long as that round runs), then by round
        ``m``'s layout (bounded by the barrier timeout).

        Round ``m``'s publisher deletes round ``m - 1``'s keys, its outcome among them: a
        newcomer that looks late (woken, then not scheduled while the others restart at
        once) finds round ``m`` published instead, and takes it."""
        if m > 0:
            outcome = self._outcome(m - 1)
            if outcome is None:
                raw = peek(self.store, self.keys.ready(m))
                return _records.layout(raw) if raw is not None else None
            if outcome.why == "complete":
                return None
            if outcome.why == "end":
                raise JobEndedError(
                    f"the job ended in round {m - 1} before rank {self.rank} could join it: "
                    f"{outcome.reason or outcome.error or ''}",
                    causes={outcome.rank: outcome.reason or ""}
                    if outcome.rank is not None
                    else None,
                )
        raw = barrier.wait_key(
            self.store, self.keys.ready(m), self.barrier_timeout, what=f"round {m} barrier"
        )
        return _records.layout(raw)

    def _outcome(self, n: int) -> RoundOutcome | None:
        """Round ``n``'s outcome once there is one; None when it is gone: round ``n + 1``
        was published and its publisher deleted round ``n``'s keys, or the job's keys are
        gone (it ended)."""
        stop = self.keys.stop(n)
        while not barrier.wait_all(self.store, [stop], _SLICE, what="round end"):
            ended = [self.keys.ready(n + 1), self.keys.exit, self.keys.ended]
            if any(self.store.check([key]) for key in ended):
                return None
        raw = peek(self.store, stop)
        return RoundOutcome.decode(raw) if raw is not None else None
