"""One heartbeat per node: the agents watch each other in a ring through the coordination store.

The ring (beats, reads, clocks, their restart when this process was starved) is
:class:`trainguard.coord.liveness.RingWatch`; this module holds the agents' judgement of a node.
Protocol (one :class:`NodeHeartbeat` per agent, every agent of a generation starts its own right
after the rendezvous, with the same ``run_id``, ``generation``, ``nodes``, ``interval`` and
``timeout``):

- Every ``interval`` the node writes its own key ``trainguard/launch/<run_id>/g<gen>/node/<node>``
  (a fresh ``<instance>/<counter>`` value each time) and reads, in one ``multi_get``, the keys of
  the nodes that follow it in ring order (``node+1, node+2, ...`` modulo ``nodes``) up to the
  first two that are still live: the first is its *target*, which it judges; the second is a
  *backup* whose clock it keeps so that, when the target is lost, the backup is judged at once
  (two adjacent nodes lost together are both found within ``timeout``). Nodes that ended or were
  declared lost are skipped. Store traffic: two operations per node per interval, O(nodes) in
  total; a key is read by at most three nodes.
- A target whose value did not change for ``timeout`` by this process's clock is lost. The node
  declares it with ``compare_set`` from the value it last saw to ``lost/<declarer>/<instance>``:
  exactly one node wins (``on_lost(node)`` runs once, in the job), a target that beat in between
  is not declared, and every other watcher sees the mark and skips the node.
- A node that ends normally writes ``bye`` (:meth:`NodeHeartbeat.close`): it is never reported.
- A node that was declared lost while it was only slow finds the mark in place of its own last
  value on its next beat: it stops beating and ``on_evicted()`` runs (its ranks were counted out).
- A replacement node (one that claimed the lost node's group rank) overwrites the mark with its own
  beats: its watcher sees the node live again and ``on_back(node)`` runs.

If this process itself saw nothing for a while (the store did not answer, or it got no CPU), that
time says nothing about the others: it starts every clock afresh, as the rank sidecars do.

A beat that failed (the store did not answer in time: a partition, a store gone) leaves its
connection behind: a reply that comes late would be read as the answer to the next request, so
the next beat connects afresh. :attr:`NodeHeartbeat.last_ok` is when the last beat that reached
the store started (the agent's fence, :mod:`trainguard.launch._fence`, judges it); the first beat
that reaches the store after failed ones calls ``on_reachable()``.

Ranks of a node: every agent publishes the global ranks of its workers with :func:`publish_ranks`
so that whoever sees the node lost can name them (:func:`node_ranks`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from trainguard import _torchcompat
from trainguard._timeouts import Timeout, seconds, shorter
from trainguard.coord.liveness import BYE, RingWatch, ring_after
from trainguard.coord.store import StoreLike
from trainguard.errors import ConfigError, CoordinationError
from trainguard.launch._keys import node_key, ranks_key

__all__ = ["NodeHeartbeat", "node_ranks", "publish_ranks"]

logger = logging.getLogger(__name__)

LOST = b"lost/"  # prefix of the mark a watcher writes over a lost node's last value

_Call = tuple[Callable[..., None], tuple[int, ...]]


class NodeHeartbeat:
    """The heartbeat of one node (agent) and its watch over the next live nodes (module doc).

    Args:
        store: a client of the coordination store; the heartbeat uses a clone of it (its own
            connection) when the store has ``clone()``.
        run_id: the rendezvous run id.
        generation: the job's generation (keys of another generation are never read).
        node: this agent's group rank, ``0 <= node < nodes``.
        nodes: the number of nodes (group world size).
        interval: seconds (or a ``timedelta``) between beats; default 1 s.
        timeout: a node whose value did not move for this long is lost; more than twice
            ``interval``; default 10 s.
        on_lost: called with a node's group rank once when this heartbeat declared it lost.
        on_back: called with a node's group rank when a node this heartbeat saw gone beats
            again as its target (a replacement node took its place).
        on_evicted: called once when this node finds itself declared lost by another.
        on_reachable: called when a beat reached the store after one or more failed.
        clock: monotonic clock in seconds (tests give a fake one and call :meth:`beat`).

    Callbacks run on the heartbeat's callback thread (``tg-node-calls``), never on the beat
    thread, so a slow callback never delays a beat; before :meth:`start` (tests that call
    :meth:`beat` themselves) they run inline.
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        run_id: str,
        generation: int,
        node: int,
        nodes: int,
        interval: Timeout = 1.0,
        timeout: Timeout = 10.0,
        on_lost: Callable[[int], None],
        on_back: Callable[[int], None] | None = None,
        on_evicted: Callable[[], None] | None = None,
        on_reachable: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not run_id:
            raise ConfigError("run_id must be a non-empty string: pass the rendezvous run id")
        for name, value in (("generation", generation), ("nodes", nodes), ("node", node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an int >= 0")
        if not 0 <= node < nodes:
            raise ConfigError(f"node={node} must be a group rank in 0..{nodes - 1} (nodes={nodes})")
        self.interval = seconds("interval", interval)
        self.timeout = seconds("timeout", timeout)
        shorter(
            "2*interval",
            2 * self.interval,
            "timeout",
            self.timeout,
            "a node must miss at least two beats before it is declared lost",
        )
        self.run_id, self.generation, self.node, self.nodes = run_id, generation, node, nodes
        self._on_lost, self._on_back, self._on_evicted = on_lost, on_back, on_evicted
        self._on_reachable = on_reachable
        self._clock = clock
        self._base = store
        self._failed = False  # the last beat failed: the next one connects afresh
        #: when (by ``clock``) the last beat that reached the store started; None before.
        self.last_ok: float | None = None
        self._key = node_key(run_id, generation, node)
        self._instance = uuid.uuid4().hex[:12].encode() + b"/"
        # the ring: its own connection, beats guarded by this instance's last value, the
        # target and its backup; ``gone`` holds the nodes this heartbeat saw gone (lost or bye)
        self._ring = RingWatch(
            self._connection(),
            lambda n: node_key(run_id, generation, n),
            me=node,
            interval=self.interval,
            timeout=self.timeout,
            window=2,
            name="node",
            blank=b"",
            prefix=self._instance,
            guarded=True,
            clock=clock,
        )
        self._successors = ring_after(node, range(nodes))
        self._window = min(2, nodes - 1)  # how many successors the next beat reads
        #: nodes this heartbeat declared lost, in order (a node again if it came back and
        #: was lost again).
        self.declared: list[int] = []
        #: the node this heartbeat judges now (None: every other node is gone).
        self.target: int | None = None
        #: True once this node found itself declared lost; it beats no more.
        self.evicted = False
        self._lock = threading.Lock()  # this node's own writes: a beat vs the goodbye
        self._closed = False
        self._stop = threading.Event()
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._beats: threading.Thread | None = None
        self._caller: threading.Thread | None = None

    def _connection(self) -> Any:
        return _torchcompat.clone_store(self._base) or self._base

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Beat once (this node's key exists when it returns), then beat every ``interval``
        on the ``tg-node-beats`` thread. Idempotent. Raises what the store raises."""
        if self._beats is not None:
            return
        self._caller = threading.Thread(target=self._run_calls, name="tg-node-calls", daemon=True)
        self._caller.start()
        self.beat()
        self._beats = threading.Thread(
            target=self._ring.run,
            args=(self._stop,),
            kwargs={
                "first": time.monotonic() + self.interval,
                "beat": self._beat_unless_evicted,
                "on_error": self._beat_failed,
            },
            name="tg-node-beats",
            daemon=True,
        )
        self._beats.start()

    def close(self, *, bye: bool = True) -> None:
        """Stop beating; with ``bye`` (a normal end) write ``bye`` so that no node reports this
        one lost. Waits up to ``timeout`` for the threads (pending callbacks run first)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(self.timeout)
        with self._lock:
            if not self._closed and bye and not self.evicted and self._ring.mine is not None:
                try:
                    self._ring.store.set(self._key, BYE)
                except Exception as exc:  # the store may be gone with the job
                    logger.warning("node %d could not say goodbye: %s", self.node, exc)
            self._closed = True
        if self._caller is not None:
            self._calls.put(None)
            self._caller.join(self.timeout)

    def _beat_unless_evicted(self) -> bool:
        if self.evicted:
            return False  # the beat thread ends
        self.beat()
        return True

    def _beat_failed(self, exc: Exception) -> None:
        self._failed = True
        logger.warning("node %d heartbeat failed: %s", self.node, exc)

    def _run_calls(self) -> None:
        while (item := self._calls.get()) is not None:
            self._invoke(item)

    def _call(self, fn: Callable[..., None] | None, *args: int) -> None:
        if fn is None:
            return
        if self._caller is None:
            self._invoke((fn, args))
        else:
            self._calls.put((fn, args))

    def _invoke(self, item: _Call) -> None:
        fn, args = item
        try:
            fn(*args)
        except Exception:
            logger.exception("node heartbeat callback %s%r failed", fn, args)

    # one interval ------------------------------------------------------------------------
    def beat(self) -> None:
        """One interval's work: write this node's beat, read the successors up to the backup,
        judge the target. Two store operations; more only right after nodes went (the read
        goes on until two live nodes are found) and once per new successor (its key is made
        sure to exist)."""
        asked = self._clock()
        if self._failed:
            self._ring.store = self._connection()  # raises while the store is out of reach
        if not self._beat_own():
            return
        self.last_ok = asked
        if self._failed:
            self._failed = False
            logger.warning("node %d reached the coordination store again", self.node)
            self._call(self._on_reachable)
        lives, start, end = 0, 0, self._window
        self.target = None
        while start < end:
            window = self._successors[start:end]
            values, now = self._ring.read(window)
            if start == 0 and self._ring.restart_clocks(asked, now):
                # This process saw nothing for a while: that time says nothing about the others.
                logger.info(
                    "node %d: no beat for %.1f s; clocks start afresh", self.node, now - asked
                )
            lives, end = self._judge(window, values, now, lives, start)
            start, end = end, min(len(self._successors), end + 2 - lives)
        self._window = end if lives == 2 else len(self._successors)

    def _beat_own(self) -> bool:
        with self._lock:
            if self._closed or self.evicted:
                return False
            got = self._ring.beat()  # a replacement node's first beat overwrites the lost mark
            if got is not None:
                self.evicted = True
                logger.error(
                    "node %d was declared lost by another node (its key holds %r); it "
                    "stops beating",
                    self.node,
                    got[:60],
                )
                self._call(self._on_evicted)
                return False
            return True

    def _judge(
        self, window: Sequence[int], values: Sequence[bytes], now: float, lives: int, offset: int
    ) -> tuple[int, int]:
        """Judge successors ``offset...`` in ring order; returns how many live nodes were
        found in all (at most two: target and backup) and where the reading may stop."""
        for i, (n, raw) in enumerate(zip(window, values, strict=True)):
            if raw == BYE or raw.startswith(LOST):
                self._went(n, raw)
                continue
            if n in self._ring.gone:
                self._ring.gone.discard(n)
                if lives == 0:  # reported by its watcher only, not by those it backs up
                    logger.warning("node %d beats again (a replacement took its place)", n)
                    self._call(self._on_back, n)
            silent = self._ring.clock(n, raw, now)
            if lives == 0 and silent >= self.timeout and not self._declare(n, raw, silent, now):
                continue
            if lives == 0:
                self.target = n
            lives += 1
            if lives == 2:
                return lives, offset + i + 1
        return lives, offset + len(window)

    def _declare(self, n: int, raw: bytes, silent: float, now: float) -> bool:
        """Mark node ``n`` lost unless it moved; True when it is still live."""
        mark = LOST + f"{self.node}/".encode() + self._instance
        got = bytes(self._ring.store.compare_set(self._ring.key(n), raw, mark))
        if got == mark:
            self._went(n, mark)
            self.declared.append(n)
            logger.warning("node %d lost: no heartbeat for %.1f s (timeout)", n, silent)
            self._call(self._on_lost, n)
            return False
        if got == BYE or got.startswith(LOST):
            self._went(n, got)
            return False
        self._ring.clock(n, got, now)  # it beat just now: its clock starts
        return True

    def _went(self, n: int, raw: bytes) -> None:
        self._ring.forget(n)
        if n not in self._ring.gone:
            self._ring.gone.add(n)
            logger.info("node %d is gone (%s)", n, "ended" if raw == BYE else "lost")


def publish_ranks(
    store: StoreLike, run_id: str, generation: int, node: int, ranks: Sequence[int]
) -> None:
    """Every agent, after its rendezvous: the global ranks of ``node``'s workers (JSON list)."""
    store.set(ranks_key(run_id, generation, node), json.dumps([int(r) for r in ranks]))


def node_ranks(store: StoreLike, run_id: str, generation: int, node: int) -> list[int] | None:
    """The global ranks ``node`` published in ``generation``; ``None`` if it never did.

    Raises :class:`CoordinationError` for a value that is not a JSON list of ints."""
    key = ranks_key(run_id, generation, node)
    if not store.check([key]):
        return None
    raw = bytes(store.get(key))
    try:
        ranks = json.loads(raw)
    except ValueError:
        ranks = None
    if not isinstance(ranks, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ranks
    ):
        raise CoordinationError(
            f"garbage under {key} in the coordination store: {raw[:200]!r}; another program "
            "writes there: give this job its own run id (--rdzv-id)"
        )
    return ranks
