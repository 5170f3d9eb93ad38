"""One node ring: each node beats one key for its members and judges the nodes after it.

Two users, one protocol: the launcher's agents (:class:`trainguard.launch._nodes.AgentNodes`; a
node's one member is its group rank) and the node watchers
(:class:`trainguard.restart.sidecar._node.NodeWatcher`; a node's members are the ranks it
watches). Beats, reads, clocks and their restart when this process was starved are
:class:`trainguard.coord.liveness.RingWatch`'s; judging what was read is
:func:`trainguard.coord.ring_judge.judge`, a pure function of the readings, clocks and time. One :class:`NodeRing` per node; every node
of a ring has the same keys, ``interval``, ``timeout``, ``window`` and the same choice of
``on_lost``. One interval of one node (:meth:`NodeRing.beat_and_look`):

1. **Position**: ``position()`` says the node's members now, the epoch (the round or the
   generation; below 0: nothing is judged yet) and the ring's members in order.
2. **Key and beat**: the node beats the key of its *leader*, its lowest member, with
   ``<members>/<instance>/<counter>`` (for example ``b"8,9,10,11/3f2a9c01d4e7/42"``; the
   instance is this object's own). When its leader leaves, it writes ``bye`` on the old key and
   beats under the new leader; with no member left it beats nothing. With ``on_lost`` the beat
   is guarded (``compare_set`` from its own last value): a lost mark found in its place means
   another node counted this one out: it stops beating and ``on_evicted()`` runs. Without, it
   is a ``set`` (nobody else writes there).
3. **Read**: the keys of the members after its leader in ring order (its own left out) until
   ``window`` of them are members not seen gone, in one ``multi_get``; the gone ones among them
   are read too (one that beats again is *back*). Each key is made to exist first, with
   ``blank`` (``NO_BEAT``: a member's key that its node never beats, as a rank that leads no
   node, is not judged; ``unbeaten``: a member that never beat is judged as one that stopped). When members went in this read it reads on until the window is full again, in
   the same interval (a lost target's backup is judged at once).
4. **Judge** (``judge``): ``bye`` ended, ``lost/...`` was counted out, a value that is no
   beat is not judged, a beat that did not change for ``timeout`` by this process's clock is
   silent; a beat that changed after this node saw its member gone is back.
5. **Count out**, one of two ways, chosen by ``on_lost``:

   - with ``on_lost`` (the agents): only the first live member read (the *target*) is judged;
     the others' clocks are kept, so that each is judged at once when it moves up. A silent
     target is marked with ``compare_set`` from the value seen to ``lost/<leader>/<instance>``:
     exactly one node wins (``on_silent``, then ``on_lost``, once in the job), a target that
     beat in between is not counted out, and every other node reads the mark and skips it;
   - without (the node watchers): every member read is judged, and every node that finds one
     silent counts out the members its value lists (those in the ring) and calls
     ``on_silent`` (the death notices it writes are idempotent: the first counts).

A look is also made at the moment an observed member's clock runs out (:attr:`RingWatch.due`,
one more ``multi_get``, only then). Store traffic: per node and interval 2 requests, whatever
its number of members: O(nodes) in all. A node that ends normally writes ``bye`` (:meth:`NodeRing.close`; never once evicted). A beat
that failed (the store did not answer) connects afresh on the next through ``connect`` (a late
reply would be read as the answer to the next request); :attr:`NodeRing.last_ok` is when the
last beat that reached the store started, and the first one after failed ones calls
``on_reachable()``. Callbacks run on the ring's callback thread (``tg-node-calls``) once
:meth:`NodeRing.start` ran, so that a slow one never delays a beat; before (tests that call
:meth:`NodeRing.beat_and_look` themselves) they run inline. No torch here: the node watcher
process imports this module.

Over 400 lines: the ring's one protocol (beat, walk, verdicts, marks, callbacks), written once
for its two users; its judgement is the pure :mod:`trainguard.coord.ring_judge` already.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from trainguard._timeouts import Timeout, seconds
from trainguard.coord.liveness import BYE, RingWatch, ring_after
from trainguard.coord.ring_judge import LOST, NO_BEAT, Verdict, judge, node_value
from trainguard.coord.store import StoreLike

__all__ = ["WINDOW", "NodeRing", "Position"]

logger = logging.getLogger(__name__)

#: how many live nodes after its own a node watcher reads each interval (those seen gone not
#: counted): a run of up to 31 nodes lost at once still has a live reader of each, whose
#: clock started before they went silent; two store operations per interval whatever it is.
WINDOW = 32

#: what a node knows of itself: its members, then the epoch and the ring's members in order
Position = tuple[tuple[int, ...], int, tuple[int, ...]]


_Call = tuple[Callable[..., None], tuple[Any, ...]]


@dataclasses.dataclass
class _Walk:
    """One look's walk along the ring: its epoch and members, the live members found."""

    epoch: int
    members: tuple[int, ...]
    roster: frozenset[int]
    lives: int = 0


class NodeRing(RingWatch):
    """One node's member of a node ring (module docstring).

    Args:
        store: the store client of the beats and reads (replaced by ``connect()`` after a
            failed beat when ``connect`` is given).
        key: the key of a node led by a member.
        position: what the node knows of itself now (:data:`Position`).
        interval, timeout: seconds (or a ``timedelta``) between beats; silent after this long.
        window: how many members after its leader it reads, those seen gone not counted.
        blank: the value a key is made to exist with (``NO_BEAT``, or ``unbeaten``).
        on_silent: called with a member this node counted out, the members its value lists
            (those in the ring), how long it was silent, and the epoch and ring members it was
            judged in.
        on_lost: called with a member once when this node's lost mark won; passing it makes
            the ring mark its silent members (module docstring, step 5).
        on_back: called with a member seen gone that beats again, by the node judging it.
        on_evicted: called once when this node finds itself marked lost by another.
        on_reachable: called when a beat reached the store after one or more failed.
        connect: a new connection to the store, made after a failed beat.
        name: what a node is, for the log.
        clock: monotonic clock in seconds (tests give a fake one).

    Protocol: :meth:`start` (one beat inline, then a beat every ``interval`` on the
    ``tg-node-beats`` thread) and :meth:`close`; or :meth:`beat_and_look` called by the owner.
    """

    def __init__(
        self,
        store: StoreLike,
        key: Callable[[int], str],
        *,
        position: Callable[[], Position],
        interval: Timeout,
        timeout: Timeout,
        window: int,
        blank: bytes | Callable[[int], bytes] = NO_BEAT,
        on_silent: Callable[[int, list[int], float, int, tuple[int, ...]], None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        on_back: Callable[[int], None] | None = None,
        on_evicted: Callable[[], None] | None = None,
        on_reachable: Callable[[], None] | None = None,
        connect: Callable[[], StoreLike] | None = None,
        name: str = "node",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.marks = on_lost is not None
        super().__init__(
            store,
            key,
            me=-1,
            interval=seconds("interval", interval),
            timeout=seconds("timeout", timeout),
            window=window,
            name=name,
            blank=blank,
            guarded=self.marks,
            clock=clock,
        )
        self.position = position
        self.on_node_silent, self.on_lost, self.on_back = on_silent, on_lost, on_back
        self.on_evicted, self.on_reachable, self.connect = on_evicted, on_reachable, connect
        self.instance = uuid.uuid4().hex[:12].encode()
        #: this node's leader (None: no member left) and members
        self.leader: int | None = None
        self.own: tuple[int, ...] = ()
        #: the value each member went with (a member whose value changes from it is back)
        self.went: dict[int, bytes] = {}
        #: members this node counted out, in order (again if one came back and went again)
        self.declared: list[int] = []
        #: the first live member of the last look (with ``on_lost``: the one it judges)
        self.target: int | None = None
        #: True once this node found itself marked lost; it beats no more
        self.evicted = False
        #: when (by ``clock``) the last beat that reached the store started; None before
        self.last_ok: float | None = None
        self._failed = False  # the last beat failed: the next one connects afresh
        self._ring: tuple[object, list[int]] = (None, [])
        self._lock = threading.Lock()  # this node's own writes: a beat vs the goodbye
        self._closed = False
        self._stop = threading.Event()
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._beats: threading.Thread | None = None
        self._caller: threading.Thread | None = None

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Beat once (inline: raises what the store raises), then every ``interval`` on the
        ``tg-node-beats`` thread; callbacks from now on on ``tg-node-calls``. Idempotent."""
        if self._beats is not None:
            return
        self._caller = threading.Thread(target=self._run_calls, name="tg-node-calls", daemon=True)
        self._caller.start()
        self.beat_and_look()
        self._beats = threading.Thread(
            target=self.run,
            args=(self._stop,),
            kwargs={"first": time.monotonic() + self.interval},
            name="tg-node-beats",
            daemon=True,
        )
        self._beats.start()

    def close(self, *, bye: bool = True, wait: Timeout | None = None) -> None:
        """Stop beating; with ``bye`` (a normal end) write ``bye`` under the leader's key so
        that no node counts this one out. Waits up to ``wait`` (default ``timeout``) for each
        thread (pending callbacks run first) and for a beat stuck in a store call."""
        join = self.timeout if wait is None else seconds("wait", wait)
        self._stop.set()
        if self._beats is not None:
            self._beats.join(join)
        if self._lock.acquire(timeout=join):
            try:
                if not self._closed and bye and not self.evicted and self.mine is not None:
                    self._bye()  # (never beat: nothing to end)
                self._closed = True
            finally:
                self._lock.release()
        else:
            logger.info("%s %s: a beat is stuck in a store call: no bye", self.name, self.leader)
        if self._caller is not None:
            self._calls.put(None)
            self._caller.join(join)

    def _bye(self) -> None:
        try:
            self.store.set(self.key(self.me), BYE)
        except Exception as exc:  # the store may be gone with the job
            logger.warning("%s %s could not say goodbye: %s", self.name, self.leader, exc)

    def failed(self, exc: Exception) -> None:
        """A beat or a look failed: the next beat connects afresh (with ``connect``)."""
        self._failed = True
        logger.warning("%s %s heartbeat failed: %s", self.name, self.leader, exc)

    def _run_calls(self) -> None:
        while (item := self._calls.get()) is not None:
            self._invoke(*item)

    def _call(self, fn: Callable[..., None] | None, *args: Any) -> None:
        if fn is not None and self._caller is None:
            self._invoke(fn, args)
        elif fn is not None:
            self._calls.put((fn, args))

    def _invoke(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("node ring callback %s%r failed", fn, args)

    # the beat ----------------------------------------------------------------------------
    def refresh(self, own: Iterable[int]) -> None:
        """Take this node's members now: a new leader says ``bye`` under the old one's key."""
        members = tuple(sorted(own))
        leader = members[0] if members else None
        if self.leader is not None and leader != self.leader:
            self.store.set(self.key(self.leader), BYE)
            self.mine = None  # the new key's first beat overwrites whatever is there
        self.leader, self.own = leader, members
        if leader is not None:
            self.me = leader
            self.prefix = node_value(members, self.instance, 0)[:-1]

    def beat_and_look(self) -> bool:
        """One interval: this node's beat (if it has members), then :meth:`look`; False once
        it was evicted or closed (no more beats)."""
        asked = self.clock_fn()
        where = self.position()
        if self._failed and self.connect is not None:
            self.store = self.connect()  # raises while the store is out of reach
        with self._lock:
            if self._closed or self.evicted:
                return False
            self.refresh(where[0])
            if self.leader is not None and (got := self.beat()) is not None:
                self.evicted = True
                logger.error(
                    "%s %d was marked lost by another node (its key holds %r); it stops beating",
                    self.name,
                    self.leader,
                    got[:60],
                )
                self._call(self.on_evicted)
                return False
        if self.leader is not None:
            self.last_ok = asked
            if self._failed:
                self._failed = False
                logger.warning("%s %d reached the coordination store again", self.name, self.me)
                self._call(self.on_reachable)
        self.look(asked, where)
        return True

    # the look ----------------------------------------------------------------------------
    def ring_of(self, epoch: int, members: tuple[int, ...]) -> list[int]:
        """The ring's members after this node's leader in ring order, its own left out."""
        key = (epoch, members, self.own)
        if self._ring[0] != key:
            own = set(self.own)
            self._ring = (key, ring_after(self.me, (m for m in members if m not in own)))
        return self._ring[1]

    def window_of(
        self, epoch: int, members: tuple[int, ...], start: int = 0, need: int | None = None
    ) -> list[int]:
        """The members a read from ``start`` on the ring covers: up to the ``need``-th
        (default ``window``-th) one not seen gone, the gone ones before it too."""
        ring, span = self.ring_of(epoch, members), []
        need = self.window if need is None else need
        for m in ring[start:]:
            if need <= 0:
                break
            span.append(m)
            need -= m not in self.gone
        return span

    def look(self, asked: float | None = None, where: Position | None = None) -> None:
        """Read the observed members' keys, judge them and count out the silent ones (module
        docstring, steps 3 to 5). Sets :attr:`due`."""
        asked = self.clock_fn() if asked is None else asked
        _, epoch, members = self.position() if where is None else where
        if epoch < 0 or self.leader is None:  # judged once its members passed a barrier
            return
        walk = _Walk(epoch, members, frozenset(members))
        self.target = None
        read: list[int] = []
        span = self.window_of(epoch, members)
        while span:
            values, now = self.read(span)
            if not read and self.restart_clocks(asked, now):
                logger.info(
                    "%s %d: no look for %.1f s; clocks start afresh",
                    self.name,
                    self.me,
                    now - asked,
                )
            read += span
            gone = {m: self.went.get(m) for m in span if m in self.gone}
            judgement = judge(
                zip(span, values, strict=True), self.seen, now, timeout=self.timeout, gone=gone
            )
            self.seen = judgement.clocks
            for verdict in judgement.verdicts:
                self._take(verdict, walk, now)
            need = self.window - sum(m not in self.gone for m in read)
            span = self.window_of(epoch, members, len(read), need)
        kept = set(read)  # whoever left the window is forgotten: back in it, it starts afresh
        self.seen = {m: c for m, c in self.seen.items() if m in kept}
        self.due = self.deadline()

    def _take(self, v: Verdict, walk: _Walk, now: float) -> None:
        """Act on one verdict of a look."""
        if v.state in ("ended", "lost"):
            self._went(v.member, v.raw)
            return
        if v.state == "gone":
            return
        judged = not self.marks or walk.lives == 0
        if v.back:
            self.gone.discard(v.member)
            self.went.pop(v.member, None)
            if judged:
                logger.warning(
                    "%s %d beats again (a replacement took its place)", self.name, v.member
                )
                self._call(self.on_back, v.member)
        if v.state == "quiet":
            return
        if judged and v.late and self._count_out(v, walk, now):
            return
        if walk.lives == 0:
            self.target = v.member
        walk.lives += 1

    def _count_out(self, v: Verdict, walk: _Walk, now: float) -> bool:
        """A silent member: count it out (True), unless its mark lost (it beat just now or is
        gone already: False for a beat, which is then live)."""
        m, raw = v.member, v.raw
        if self.marks:
            mark = LOST + f"{self.me}/".encode() + self.instance
            got = bytes(self.store.compare_set(self.key(m), raw, mark))
            if got != mark:
                if got == BYE or got.startswith(LOST):
                    self._went(m, got)
                    return True
                self.seen[m] = (got, now)  # it beat just now: its clock starts
                return False
            raw = mark
        counted = [r for r in v.members if r in walk.roster]
        self.gone.update(counted)
        self._went(m, raw)
        self.declared.append(m)
        logger.warning(
            "%s %d silent: no heartbeat for %.1f s (timeout); members %s counted out",
            self.name,
            m,
            v.silent,
            counted,
        )
        self._call(self.on_node_silent, m, counted, v.silent, walk.epoch, walk.members)
        self._call(self.on_lost, m)
        return True

    def _went(self, m: int, raw: bytes) -> None:
        self.forget(m)
        self.went[m] = raw
        if m not in self.gone:
            self.gone.add(m)
            why = "ended" if raw == BYE else "counted out"
            logger.info("%s %d is gone (%s)", self.name, m, why)
