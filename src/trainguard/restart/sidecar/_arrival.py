"""Node arrival: a node's helper arrives at each barrier for the ranks it watches.

The helper is the node watcher (:mod:`._node`) or, under ``trainguard launch``, the agent
(:mod:`.agent_service`): one :class:`NodeArrival` per wrapped call each. A rank arriving by
itself costs two store requests (its record, its count); through its helper the store's work
per round is O(nodes), not O(ranks):

1. The round's records are pooled (:mod:`trainguard.restart._book`: lines appended to one
   value per round, a departure wins over any arrival of the same rank), by every writer of
   the job: ranks, notices, newcomers, node watchers.
2. A rank sends ``{"arrive": n, "record": ...}`` to its watcher over the Unix socket it
   already holds, asks the watcher's relay for round ``n``'s layout, and waits for it
   (:meth:`Session.arrive <trainguard.restart._session.Session.arrive>`). A leaving rank
   arrives at the store itself and sends ``{"arrive": n, "direct": 1}`` so that its node
   does not wait for it.
3. :class:`NodeArrival` keeps a batch per round. It flushes round ``n``'s batch (one
   ``append`` of every record in it, then one ``add`` of their number) as soon as every rank
   it is waiting for has sent its record or arrived itself, or has ended (died or said
   goodbye: its watch tells it before writing the notice, which appends the rank's departure
   to the pool itself). The ranks it waits for are the live ranks of this call whose last
   announced round is before ``n`` and whose roster holds them, or that announced none yet
   when ``n`` is 0 (a newcomer arrives on its own: outside the roster, it pools its record
   uncounted). A rank whose record comes after the flush makes a batch of
   its own.
4. When the ``add`` reaches the roster (the sender's roster of round ``n - 1``), the watcher
   is the last arriver: it reads the pool (one key), lays the round out with the Wrapper's
   policies (:meth:`SidecarConfig.round_policies`; the defaults when they could not be
   pickled, as for a notice) and publishes it, exactly as a rank would. The job's history
   (ranks gone, repeated faults) comes from round ``n - 1``'s layout, which its relay has
   already read for its ranks (read from the store only when it has not).

The bound (:data:`BOUND_S`): holding a record back costs the barrier nothing while the rank
it waits for will arrive through this watcher, since the round cannot be laid out before
every rank of the roster has a record: its node's record goes in one request after it. A
rank that will never send (it hangs before its barrier, or went to the store on its own
because its relay failed) ends by its death (the hard timeout kills it; its watch ends and
the batch goes at once) or is laid out late anyway. So the bound is only a safety net for
such a rank, and the latest a held record reaches the store is :data:`BOUND_S` after the
batch's first record: far below the hard and heartbeat timeouts after which today's barrier
would go on without a rank that never comes.

A rank whose watcher dies before flushing its record arrives at the store itself when its
relay fails (:meth:`Session.take <trainguard.restart._session.Session.take>`); a second
record of the same rank is harmless (the first arrival counts, departures win). Its
watchdog then takes it out of the job (``SidecarLostError``), as without node arrival.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.coord.store import StoreLike
from trainguard.restart import _records
from trainguard.restart._book import RoundBook
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._notice import follow
from trainguard.restart.sidecar._watch import Watch

__all__ = ["BOUND_S", "NodeArrival"]

logger = logging.getLogger("trainguard.restart.sidecar")

#: seconds a batch waits, at most, for the ranks that have not sent their record yet
BOUND_S = 1.0


class _Batch:
    def __init__(self) -> None:
        self.records: dict[int, bytes] = {}  # rank -> its encoded record, not yet flushed
        self.done: set[int] = set()  # ranks flushed or arrived on their own
        self.since = 0.0  # when the first record of the pending ones came
        self.roster: Sequence[int] = ()
        self.cfg: SidecarConfig | None = None


class NodeArrival:
    """One node's arrivals for the ranks of one wrapped call; see the module docstring.

    Args:
        connect: makes the store connection of the flushes (made on first use).
        previous: the relay's copy of a round's layout, if it has one (``previous(n)``).
    """

    def __init__(
        self,
        connect: Callable[[], StoreLike],
        previous: Callable[[int], bytes | None] | None = None,
    ) -> None:
        self._connect = connect
        self._previous = previous
        self._cond = threading.Condition()
        self._live: dict[Watch, None] = {}  # the watches of ranks alive and not gone
        self._batches: dict[int, _Batch] = {}
        self._closed = False
        self._store: StoreLike | None = None
        self._thread: threading.Thread | None = None
        #: flushes made and records flushed (for tests and benchmarks)
        self.flushes = 0
        self.records = 0
        #: round -> CPU seconds of the flush that laid it out (for benchmarks)
        self.laid: dict[int, float] = {}

    def watch(self, watch: Watch) -> None:
        """Wait for ``watch``'s rank at the barriers from now on; its hooks go to this."""
        with self._cond:
            self._live[watch] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tg-arrival", daemon=True)
                self._thread.start()
        watch.on_arrive = lambda msg: self._arrive(watch, msg)
        watch.on_end = lambda: self._end(watch)

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is pending, stop the thread (up to ``timeout``), close the connection."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._drop()

    def _drop(self) -> None:
        """Close the flushes' connection (the next flush makes a new one)."""
        store, self._store = self._store, None
        close = getattr(store, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    # the watches' hooks --------------------------------------------------------------------
    def _arrive(self, watch: Watch, msg: dict[str, Any]) -> None:
        n = int(msg["arrive"])
        with self._cond:
            batch = self._batches.setdefault(n, _Batch())
            if "record" not in msg:  # it arrives on its own
                batch.done.add(watch.rank)
            else:
                rec = _records.record(str(msg["record"]))
                if rec is None or rec.rank != watch.rank:
                    logger.warning("rank %d sent a record that is not its own", watch.rank)
                    return
                if not batch.records:
                    batch.since = time.monotonic()
                batch.records[watch.rank] = rec.encode()
                batch.roster = watch.position()[1]  # round n - 1's: round n's barrier's
                batch.cfg = watch.cfg
            self._cond.notify_all()

    def _end(self, watch: Watch) -> None:
        with self._cond:
            self._live.pop(watch, None)
            self._cond.notify_all()

    # the flushing thread -------------------------------------------------------------------
    def _waiting(self, n: int, batch: _Batch) -> set[int]:
        """The ranks round ``n``'s batch still waits for (lock held)."""
        waiting = set()
        for watch in self._live:
            p, roster = watch.position()
            if (p < 0 and n == 0) or (0 <= p < n and watch.rank in roster):
                waiting.add(watch.rank)
        return waiting - batch.done - set(batch.records)

    def _due(self) -> tuple[int, _Batch, float | None]:
        """A round whose records are due now (n, batch) or (-1, _, seconds to the next due
        one, None: none pending); lock held."""
        now, soonest = time.monotonic(), None
        for n, batch in sorted(self._batches.items()):
            if not batch.records:
                continue
            left = batch.since + BOUND_S - now
            if self._closed or left <= 0 or not self._waiting(n, batch):
                return n, batch, None
            soonest = left if soonest is None else min(soonest, left)
        return -1, _Batch(), soonest

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    n, batch, left = self._due()
                    if n >= 0 or (self._closed and left is None):
                        break
                    self._cond.wait(left)
                if n < 0:
                    return
                records, batch.records = batch.records, {}
                batch.done.update(records)
                roster, cfg = batch.roster, batch.cfg
                for old in [k for k in self._batches if k < n - 2]:
                    del self._batches[old]
            assert cfg is not None
            for attempt in (1, 2):  # again on a new connection (twice the same is harmless)
                try:
                    self._flush(n, records, roster, cfg)
                    break
                except Exception:
                    logger.exception(
                        "node arrival: could not arrive for ranks %s (try %d of 2)",
                        sorted(records),
                        attempt,
                    )
                    self._drop()

    def _flush(
        self, n: int, records: dict[int, bytes], roster: Sequence[int], cfg: SidecarConfig
    ) -> None:
        """Arrive at round ``n``'s barrier for ``records``: one append, one add; publish the
        round when that add completes the barrier."""
        if self._store is None:
            self._store = self._connect()
        book = RoundBook(
            self._store,
            cfg.keys,
            cfg.world,
            cfg.round_policies(),
            store_timeout=cfg.store_timeout,
            roster=roster,
        )
        self._history(book, n - 1)
        start, cpu = time.monotonic(), time.thread_time()
        book.pool(n, list(records.values()))
        published = book.arrive(n, len(records))
        self.flushes += 1
        self.records += len(records)
        if published is not None:
            self.laid[n] = time.thread_time() - cpu
        logger.info(
            "node arrival: round %d, ranks %s in one append and one add (%.1f ms)%s",
            n,
            sorted(records),
            1000 * (time.monotonic() - start),
            "; laid the round out" if published is not None else "",
        )

    def _history(self, book: RoundBook, n: int) -> None:
        """Give ``book`` the ranks gone and the repeated faults as of round ``n``: from the
        relay's copy of its layout, else read (only the last arriver lays a round out, but
        which flush is the last is known only after its add)."""
        raw = self._previous(n) if self._previous is not None and n >= 0 else None
        if raw is None:
            follow(book, n)
            return
        ready = _records.layout(raw)
        book.gone = dict(ready.gone)
        book.repeats = ready.repeats
        book.health = ready.health
