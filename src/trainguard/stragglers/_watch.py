"""The detector of one wrapped call on one rank: a thread that scores each window.

Protocol, per round on each active rank (the wrapper calls :meth:`StragglerWatch.start` before
the function and :meth:`StragglerWatch.stop` after it, whatever happened):

1. The training thread records samples (:mod:`._timing`); at the end of window ``k`` (every
   ``every`` pings) it queues ``k`` for the detector thread, nothing else.
2. The detector thread appends this rank's medians as one line to the round store's key of
   window ``k`` (``append``: one operation, whatever the world size) and reads window
   ``k-1``'s key (``get``: it exists, this rank appended to it). Ranks that did not publish
   ``k-1`` yet (hung, or more than a window behind) are simply absent: nothing waits for
   them. In a synchronous job every live rank published ``k-1`` before any rank ends ``k``.
3. From those entries it computes the scores (:mod:`.scores`); the rank whose relative score
   is below the threshold emits a ``straggler`` event, and the round's rank 0 emits
   ``straggler_window`` (the slowest ranks, who is missing) and deletes window ``k-8`` (a
   rank that far behind finds its previous window gone, checks first and skips it: a
   ``get`` of a missing key would wait).
4. With :class:`~trainguard.stragglers.TakeOutStragglers`: after ``windows`` straggling
   windows in a row it claims a removal (rate limit, coordination store) and proposes the
   fault ``Straggler`` for the round; the policy then takes the rank out at the health check.

The window keys live in the round's own store, which is closed when the next round starts.

The detector knows nothing of the restart machinery that runs it: it is given the call's
keyspace, a way to open its own coordination connection and a ``propose`` callable for the
round's fault (:class:`StragglerWatch`), and it reads the round through :class:`RoundView`,
which the restart's ``RoundState`` satisfies.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from trainguard import events
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike, connect, parse_addr
from trainguard.stragglers import _timing
from trainguard.stragglers.config import Stragglers
from trainguard.stragglers.scores import (
    RankScore,
    entry_line,
    individual,
    parse_entries,
    relative,
    slowest,
)

__all__ = ["Propose", "RoundView", "StragglerWatch"]

logger = logging.getLogger(__name__)

_MAX_RANK = 1 << 24  # initial ranks read back from the store must be below this
_KEEP = 8  # rank 0 deletes window k - _KEEP at window k: a rank that far behind skips a window


class RoundView(Protocol):
    """What the detector reads of a round (the restart's ``RoundState`` is one)."""

    @property
    def round(self) -> int: ...
    @property
    def initial_rank(self) -> int: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def active_ranks(self) -> Sequence[int]: ...


#: ``(round, why)``: propose the fault ``Straggler`` of this rank for ``round``; True when
#: that proposal won (it is the round's outcome).
Propose = Callable[[int, str], bool]


class StragglerWatch:
    """Straggler detection for one wrapped call on one rank (see the module docstring).

    Args:
        cfg: the settings.
        keys: the call's keyspace (window keys per round; the rate limit's slots).
        clone: opens a new connection to the coordination store (the rate limit's claim).
        propose: proposes this rank's ``Straggler`` fault for a round (see :data:`Propose`).
        timeout: store operation timeout (seconds).
    """

    def __init__(
        self,
        cfg: Stragglers,
        keys: Keyspace,
        *,
        clone: Callable[[], StoreLike],
        propose: Propose,
        timeout: float,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.clone = clone
        self.propose = propose
        self.timeout = timeout
        self.best: dict[str, float] = {}  # this rank's best medians, kept across rounds
        self._round: _Round | None = None

    def start(self, state: RoundView, pg_addr: str) -> _timing.Timer:
        """Round ``state.round`` begins on this active rank: its timer (made current)."""
        self.stop()
        self._round = _Round(self, state, pg_addr)
        _timing.use(self._round.timer)
        return self._round.timer

    def stop(self) -> None:
        """The round ended on this rank: stop its thread, drop its store client."""
        _timing.use(None)
        if self._round is not None:
            self._round.close()
            self._round = None


class _Round:
    def __init__(self, watch: StragglerWatch, state: RoundView, pg_addr: str) -> None:
        cfg = watch.cfg
        assert cfg.window is not None
        self.watch, self.state, self.pg_addr = watch, state, pg_addr
        self.prefix = watch.keys.round_prefix(state.round) + "strag/"
        self.queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.timer = _timing.Timer(
            window=cfg.window, every=cfg.every, on_window=self.queue.put, cuda=cfg.cuda
        )
        self.mine: dict[int, dict[str, float]] = {}
        self.below = 0
        self.acted: str | None = None
        self.warned = False
        self.thread = threading.Thread(target=self._run, name="trainguard-stragglers", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(self.watch.timeout + 5.0)

    def _run(self) -> None:
        store: StoreLike | None = None
        try:
            while (k := self.queue.get()) is not None:
                try:
                    if store is None:
                        store = connect(*parse_addr(self.pg_addr), timeout=self.watch.timeout)
                    self._window(store, k)
                except Exception as exc:  # the round's store closes when the round ends
                    if not self.warned:
                        self.warned = True
                        logger.info("straggler window %d not scored: %s", k, exc)
        finally:
            del store

    def _window(self, store: StoreLike, k: int) -> None:
        medians = self.timer.medians()
        if not medians:
            return
        irank = self.state.initial_rank
        store.append(f"{self.prefix}{k}", entry_line(irank, medians))
        self.mine[k] = medians
        prev = self.mine.pop(k - 1, None)
        key = f"{self.prefix}{k - 1}"
        if prev is None or not store.check([key]):  # a rank far behind: rank 0 deleted it
            return
        entries = parse_entries(store.get(key), _MAX_RANK)
        scores = relative(entries, self.watch.cfg.floor)
        own, where = individual(prev, self.watch.best, self.watch.cfg.floor)
        if self.state.rank == 0:
            self._summary(k - 1, scores, own)
            if k > _KEEP:
                store.delete_key(f"{self.prefix}{k - _KEEP}")
        mine = scores.get(irank)
        if mine is None or mine.score >= self.watch.cfg.threshold:
            self.below = 0
            return
        self.below += 1
        action = self._act(mine)
        events.emit(
            "straggler",
            window=k - 1,
            section=mine.section,
            relative=round(mine.score, 4),
            individual=round(own, 4),
            individual_section=where,
            seconds=mine.own,
            fastest=mine.fastest,
            fastest_rank=mine.fastest_rank,
            windows_below=self.below,
            rank_in_round=self.state.rank,
            action=action,
        )

    def _summary(self, window: int, scores: dict[int, RankScore], own: float) -> None:
        threshold = self.watch.cfg.threshold
        missing = sorted(set(self.state.active_ranks) - set(scores))
        events.emit(
            "straggler_window",
            window=window,
            ranks=len(scores),
            missing=missing,
            named=sorted(r for r, s in scores.items() if s.score < threshold),
            slowest=[[s.rank, round(s.score, 4), s.section] for s in slowest(scores.values(), 3)],
            individual=round(own, 4),
        )

    def _act(self, mine: RankScore) -> str:
        """What the policy does about this straggling window: the event's ``action``."""
        take_out = self.watch.cfg.take_out
        if take_out is None:
            return "reported"
        if self.acted is not None:
            return self.acted
        if self.below < take_out.windows:
            return "reported"
        watch, irank, n = self.watch, self.state.initial_rank, self.state.round
        why = (
            f"straggler: relative score {mine.score:.2f} in section {mine.section!r} "
            f"({mine.own * 1e3:.2f} ms vs {mine.fastest * 1e3:.2f} ms on rank "
            f"{mine.fastest_rank}) below {self.watch.cfg.threshold:g} for {self.below} windows"
        )
        coord = watch.clone()
        try:
            if not take_out.claim(coord, watch.keys.prefix + "strag/", irank):
                self.acted = "rate limited"
                return self.acted
        finally:
            del coord
        self.acted = "taken out"
        take_out.verdict = why
        logger.warning("rank %d: %s; it leaves the job", irank, why)
        if watch.propose(n, why):
            events.emit("fault", error=why, type="Straggler")
        return self.acted
