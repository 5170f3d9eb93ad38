"""Node liveness: the node watcher beats once for its node and watches the nodes after it.

Under node arrival (``TRAINGUARD_NODE_ARRIVAL=1``, the same on every node) and the node
watcher (``TRAINGUARD_SIDECAR=node``, :mod:`._node`), the watcher knows its own ranks'
liveness without the store (each rank's pidfd and lines, :class:`._watch.Watch`): the store
only has to carry the node's. So the watches beat nothing of their own, and one
:class:`NodeLiveness` per watcher is the node's member of a ring of nodes
(:class:`trainguard.coord.liveness.RingWatch`, whose beat, read, clocks and starvation rule
it uses):

- **Key**: the node is named by its *leader*, the lowest rank it watches (initial rank, alive,
  not gone). It beats :meth:`Keyspace.node_heartbeat(leader) <trainguard.coord.keys.Keyspace>`
  with ``set``; the value is the ranks it watches, then its counter:
  ``b"8,9,10,11,12,13,14,15/42"``. When its leader leaves (died or said goodbye) it writes
  ``bye`` on the old key and beats under the new leader; with no rank left it writes ``bye``.
- **Read**: one ``multi_get`` of the node keys of the :data:`WINDOW` ranks that follow its
  leader in the round's roster (initial-rank order, ring), its own ranks and the ranks seen
  gone left out. Only a leader's key holds a beat: the others stay at their blank value (made
  once, as :meth:`RingWatch.ensure` does) and are not judged. With a node's ranks consecutive
  (as torchrun hands them out), 32 ranks are the next 4 nodes of 8: every node is watched by
  the nodes before it, so losing a few of them blinds nobody.
- **Judge**: a node key whose value did not change for ``heartbeat_timeout`` by this
  process's clock is silent: every rank it lists that is in the round's roster is declared
  gone (``on_silent``: the node watcher writes a death notice for each, as the rank ring does
  for one rank; a notice is idempotent, the first counts the rank out). ``bye`` is gone
  without a notice (its ranks' own notices are written by their watcher); a value that is no
  ``ranks/counter`` is not judged. A look is also made at the moment an observed node's
  clock runs out (one more ``multi_get``, only then).

Store traffic: per node and interval 2 requests (the beat and the read), whatever its number
of ranks: O(nodes) in total (the per-rank ring makes 2 per rank). Not mixed with the per-rank
ring: a job runs one or the other on every node (a per-rank sidecar reads ``hb/<rank>`` keys
that a node under this mode never beats, so it would judge none of its ranks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from trainguard.coord.keys import Keyspace
from trainguard.coord.liveness import BYE, MAX_DIGITS, RingWatch, ring_after
from trainguard.coord.store import StoreLike
from trainguard.restart.sidecar._watch import WINDOW, Watch

__all__ = ["NodeLiveness", "NodeRing", "parse_node_value"]

logger = logging.getLogger("trainguard.restart.sidecar")

#: the most ranks one node key may list (a value listing more is not judged)
MAX_RANKS = 4096

#: what a node knows of itself: its ranks, then the newest round it saw and that round's roster
Position = tuple[tuple[int, ...], int, tuple[int, ...]]


def parse_node_value(raw: bytes) -> tuple[list[int], int] | None:
    """A node key's value as (its ranks, its counter); None for a blank, ``bye`` or any value
    that is not ``ranks/counter``."""
    head, sep, counter = raw.rpartition(b"/")
    if not sep or not counter.isdigit() or len(counter) > MAX_DIGITS:
        return None
    parts = head.split(b",") if head else []
    if len(parts) > MAX_RANKS or not all(p.isdigit() and len(p) <= 9 for p in parts):
        return None
    return [int(p) for p in parts], int(counter)


class NodeRing(RingWatch):
    """One node's beat and its look over the nodes after it (module docstring).

    Args:
        store: the store client of the beats and reads.
        keys: the wrapped call's keyspace.
        interval, timeout: seconds between beats; silent after this long.
        position: what the node knows of itself now (:data:`Position`).
        on_silent: called with an observed node's leader, its ranks in the roster, how long
            it was silent, and the round and roster it was judged in.
        window: how many ranks after its leader it reads the node keys of.
    """

    def __init__(
        self,
        store: StoreLike,
        keys: Keyspace,
        *,
        interval: float,
        timeout: float,
        position: Callable[[], Position],
        on_silent: Callable[[int, list[int], float, int, tuple[int, ...]], None],
        window: int = WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            store,
            keys.node_heartbeat,
            me=-1,
            interval=interval,
            timeout=timeout,
            window=window,
            name="node",
            clock=clock,
        )
        self.position = position
        self.on_node_silent = on_silent
        self.leader: int | None = None
        self.ranks: tuple[int, ...] = ()
        self._cache: tuple[object, list[int]] = (None, [])

    # the beat ----------------------------------------------------------------------------
    def refresh(self, ranks: tuple[int, ...]) -> None:
        """Take this node's ranks now: a new leader says ``bye`` under the old one's key."""
        leader = min(ranks) if ranks else None
        if self.leader is not None and leader != self.leader:
            self.store.set(self.key(self.leader), BYE)
        self.leader, self.ranks = leader, ranks
        if leader is not None:
            self.me = leader
            self.prefix = b",".join(str(r).encode() for r in ranks) + b"/"

    def beat_and_look(self) -> bool:
        """The node's interval: its beat (if it has ranks), then :meth:`look`."""
        ranks, _, _ = self.position()
        self.refresh(tuple(sorted(ranks)))
        if self.leader is not None:
            self.beat()
        self.look()
        return True

    def bye(self) -> None:
        """The node ends: ``bye`` under its leader's key."""
        self.refresh(())

    # the look ----------------------------------------------------------------------------
    def window_of(self, epoch: int, roster: tuple[int, ...]) -> list[int]:
        """The ranks whose node keys this node reads: the first ``window`` after its leader
        in ``roster``, its own and those seen gone left out."""
        key = (epoch, len(self.gone), self.ranks)
        if self._cache[0] == key:
            return self._cache[1]
        own = set(self.ranks)
        others = (r for r in roster if r not in own and r not in self.gone)
        window = ring_after(self.me, others)[: self.window]
        self._cache = (key, window)
        return window

    def look(self) -> None:
        """Read the observed node keys (one ``multi_get``) and judge each (module docstring).
        Sets :attr:`due`."""
        asked = self.clock_fn()
        _, epoch, roster = self.position()
        if epoch < 0 or self.leader is None:  # judged once its ranks passed a barrier
            return
        observed = self.window_of(epoch, roster)
        if not observed:
            return
        values, now = self.read_window(observed, asked)
        in_roster = set(roster)
        for m, raw in zip(observed, values, strict=True):
            if raw == BYE:  # that leader left: its node goes on under another key, or ended
                self.gone.add(m)
                self.forget(m)
                continue
            parsed = parse_node_value(raw)
            if parsed is None:
                continue  # not a leader's key (or never beat): not judged
            silent = self.clock(m, raw, now)
            if silent >= self.timeout:
                ranks = [r for r in parsed[0] if r in in_roster]
                self.gone.update(ranks)
                self.gone.add(m)
                self.forget(m)
                self.on_node_silent(m, ranks, silent, epoch, roster)
        self.due = self.deadline()


class NodeLiveness:
    """The node watcher's node liveness: its watches' ranks, one :class:`NodeRing` beating
    on the node's shared connection in a thread (``tg-node-beats``), and the notices of the
    ranks of a silent node (each on a connection of its own, through a live watch)."""

    def __init__(self, store: StoreLike, keys: Keyspace, *, interval: float, timeout: float):
        self._lock = threading.Lock()
        self._watches: dict[Watch, None] = {}
        self._stop = threading.Event()
        self.ring = NodeRing(
            store,
            keys,
            interval=interval,
            timeout=timeout,
            position=self.position,
            on_silent=self.silent,
        )
        self._thread = threading.Thread(target=self._run, name="tg-node-beats", daemon=True)
        self._thread.start()

    def watch(self, watch: Watch) -> None:
        """Count ``watch``'s rank as this node's from now on."""
        with self._lock:
            self._watches[watch] = None

    def forget(self, watch: Watch) -> None:
        """``watch`` ended (its rank died or said goodbye): no longer this node's."""
        with self._lock:
            self._watches.pop(watch, None)

    def position(self) -> Position:
        """The ranks of the live watches, and the newest round one of them announced."""
        with self._lock:
            live = [w for w in self._watches if not w.done.is_set()]
        ranks = tuple(sorted(w.rank for w in live))
        newest = max((w.position() for w in live), key=lambda p: p[0], default=(-1, ()))
        return ranks, newest[0], newest[1]

    def silent(
        self, leader: int, ranks: list[int], silent: float, n: int, roster: tuple[int, ...]
    ) -> None:
        """The node of ``leader`` is silent: a death notice for each of its ranks."""
        cause = f"its node silent: no node heartbeat for {silent:.1f} s (heartbeat_timeout)"
        logger.warning("node of rank %d is silent: ranks %s gone", leader, ranks)
        with self._lock:
            live = [w for w in self._watches if not w.done.is_set()]
        if not live:
            return
        for r in ranks:
            live[0].notices.append(live[0].notice_thread(r, n, roster, cause))

    def _run(self) -> None:
        self.ring.run(self._stop)

    def close(self) -> None:
        """Stop the beats (not waited for when stuck in a store call) and say ``bye``."""
        self._stop.set()
        self._thread.join(1.0)
        try:
            self.ring.bye()
        except Exception as exc:  # the store may be gone with the job
            logger.info("node heartbeat bye not written: %s", exc)
