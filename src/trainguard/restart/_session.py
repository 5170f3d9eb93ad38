"""One wrapped call's coordination: store connections, the store process, barriers, leaving.

Over 400 lines: one class, a rank's side of every store exchange of a wrapped call (connect,
barrier, outcome, leaving) in the order a call goes through them; node arrival added its path
beside the direct and the relayed one in the same methods, where a reader compares them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from trainguard import _env, _torchcompat, events
from trainguard._addr import is_local_address
from trainguard.coord import StartNotice, _secret, barrier, bind_host
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike, StoreProcess, connect, parse_addr
from trainguard.errors import CoordinationError, RestartError
from trainguard.restart import _records
from trainguard.restart._book import RoundBook, peek
from trainguard.restart._environment import Launch
from trainguard.restart._join import Newcomer, Notify
from trainguard.restart._records import BarrierRecord, RoundLayout
from trainguard.restart.config import WrapperConfig
from trainguard.restart.sidecar._relay import RelayReader
from trainguard.restart.state import RoundOutcome

logger = logging.getLogger(__name__)

_detached: list[StoreProcess] = []  # store processes left serving the job after rank 0 left


class Session:
    """Store side of one wrapped call on one rank (built and closed by the Wrapper).

    The barrier records live in a :class:`RoundBook` (:attr:`book`, made by :meth:`open`) that
    this rank keeps on its coordination connection (:attr:`coord`), which never blocks for
    long (the watchdog's and the pre-connect's threads share it). The long waits, the
    monitor's for a round's outcome during the round (:meth:`outcome`) and the main thread's
    for the next round's layout between rounds (:meth:`take`), go to the node watcher's relay
    when this rank's helper has one (:mod:`.sidecar._relay`: one store read per node), else to
    a second connection of this rank's own (:attr:`watch_store`); see :meth:`watch`.

    Under node arrival (``TRAINGUARD_NODE_ARRIVAL=1``) the records are pooled
    (:mod:`._book`), and a rank whose helper is the node watcher hands its record to it
    instead of arriving at the store (:meth:`arrive`; :mod:`.sidecar._arrival`).
    """

    def __init__(self, launch: Launch, call: int, cfg: WrapperConfig) -> None:
        self.launch = launch
        self.cfg = cfg
        self.keys = Keyspace(launch.job, call)
        self.irank = launch.rank
        self.world = launch.world_size
        self.host = _env.settings().host_name or socket.gethostname()
        self.book: RoundBook | None = None
        self.watch_store: StoreLike | None = None
        self.relay: RelayReader | None = None
        #: the node watcher that arrives for this rank (node arrival, see :meth:`arrive`)
        self.node: Any = None
        self._sent: tuple[int, BarrierRecord] | None = None  # the record it took last
        self._lock = threading.Lock()  # the monitor's and the main thread's waits
        self.server: StoreProcess | None = None
        self.standby: StoreProcess | None = None  # round stores on a second host
        self.left = False
        self.coord_addr: tuple[str, int] | None = None
        self.secret: _secret.Handover | None = None
        #: this process joins the running job (a respawn, or its rank is gone): see :meth:`join`
        self.joining = launch.incarnation > 0
        #: the job had ended before this newcomer could learn its secret: nothing to join
        self.over = False

    @property
    def coord(self) -> StoreLike:
        """This rank's connection to the coordination store (open sessions only)."""
        assert self.book is not None, "the session is not open"
        return self.book.store

    @property
    def roster(self) -> Sequence[int]:
        """The ranks of the current round (active then spares); all before the first."""
        return self.book.roster if self.book is not None else tuple(range(self.world))

    # setup --------------------------------------------------------------------------------
    def open(self) -> None:
        cfg, launch = self.cfg, self.launch
        given = cfg.store
        if given is None:
            addr = _env.settings().store_addr
            if addr is not None:
                given = f"{addr[0]}:{addr[1]}"
        if given is None and launch.agent_store:
            given = f"{launch.master_addr}:{launch.master_port}"
        if isinstance(given, str):
            host, port = parse_addr(given)
            own = False
        elif given is not None:  # a TCPStore object
            host, port, own = given.host, given.port, False
        else:
            host, port, own = launch.master_addr, launch.master_port, True
        self.coord_addr = (host, port)
        self.secret = _secret.Handover(self.keys, _secret.source(launch.master_addr))
        first = self.irank == 0 and not self.joining  # a respawned rank 0 finds them running
        notice = StartNotice(self.keys.job, self.keys.call, host, port)
        if first:
            self.keys = self.keys.with_secret(self.secret.create())
            notice.clear()
            try:
                self.server = self._start_server(host, port, own)
            except CoordinationError as exc:
                notice.publish(str(exc))  # the others fail at once with it
                raise
        gave_up = None if first else notice.failure
        coord: StoreLike
        if given is not None and not isinstance(given, str):
            coord = given.clone()  # the user's TCPStore (its clone() is checked by the config)
        else:
            coord = connect(host, port, timeout=cfg.store_timeout, gave_up=gave_up)
        if first:
            self.secret.publish(coord)
        else:
            ended = self.keys.ended if self.joining else None
            secret = self.secret.receive(coord, cfg.barrier_timeout, ended=ended, gave_up=gave_up)
            self.over = secret is None  # a newcomer that came after the job ended
            if secret is not None:
                self.keys = self.keys.with_secret(secret)
                self.joining = self.joining or peek(coord, self.keys.latest) is not None
        if not own and not self.joining and not self.over and self._hosts_standby():
            self.standby = self._start_server(host, port, False, standby=True)
        self.book = RoundBook(
            coord,
            self.keys,
            self.world,
            cfg.policies,
            store_timeout=cfg.store_timeout,
            writer=self.irank,
        )

    def watch(self, helper: Any) -> StoreLike:
        """Where the long waits go (after :meth:`open`, before the first barrier): the relay
        of ``helper`` (this rank's sidecar handle) when it has one, else a new connection of
        this rank's own. Returns the store connection that the monitor may write to when it
        closes (:attr:`watch_store`, or :attr:`coord` when relayed)."""
        self.relay = getattr(helper, "relay", None)
        if getattr(helper, "arrival", False):
            self.node = helper
        return self._watch_store() if self.relay is None else self.coord

    def outcome(self, n: int) -> bytes:
        """Round ``n``'s outcome, waited for as long as it takes (the monitor's thread)."""
        relay = self.relay
        if relay is not None:
            try:
                value = relay.wait("stop", n, None)
                assert value is not None  # no time limit
                return value
            except CoordinationError as exc:
                self._unrelay(exc)
        return barrier.wait_forever(self._watch_store(), self.keys.stop(n))

    def _unrelay(self, exc: CoordinationError) -> None:
        """The relay failed (the watcher died): wait at the store, and arrive there, from now
        on. The watchdog
        sees the watcher's loss on its own and takes this rank out (``SidecarLostError``)
        through a round outcome, which this rank must still be able to see."""
        logger.warning("%s; waiting at the store instead", exc)
        self.relay = self.node = None

    def _watch_store(self) -> StoreLike:
        """The connection of the long waits without a relay (made on first use)."""
        with self._lock:
            if self.watch_store is None:
                self.watch_store = self.clone_coord()
            return self.watch_store

    def clone_coord(self) -> StoreLike:
        """A new connection to the coordination store, of the caller's own."""
        clone = _torchcompat.clone_store(self.coord)
        if clone is None:  # a user's store is checked for clone(); connect() makes clients
            raise CoordinationError("the coordination store's client cannot be cloned")
        return clone

    def _hosts_standby(self) -> bool:
        """Whether this rank starts the standby store process: local rank 0 of node 1 (the
        first rank on a second host), in a job whose coordination store lives neither in the
        first store process nor on rank 0's host (else losing that host loses the job anyway)."""
        coord_host = self.coord_addr[0] if self.coord_addr is not None else None
        first = self.irank == 0 or self.launch.master_addr == coord_host
        return self.launch.node == 1 and self.launch.local_rank == 0 and not first

    def _start_server(
        self, host: str, port: int, own: bool, *, standby: bool = False
    ) -> StoreProcess:
        """Rank 0: the store process (``standby``: the standby on a second host). The round
        stores live on this machine; ranks reach it by MASTER_ADDR when that names it (always so
        when it hosts the coordination store), else by name; they listen on that interface
        only."""
        master = self.launch.master_addr
        local = own or (not standby and is_local_address(master))
        advertise = master if local else self.host
        return StoreProcess(
            job=self.keys.job,
            call=self.keys.call,
            secret=self.keys.secret,
            coord_host=host,
            coord_port=port,
            host_coord=own,
            advertise_host=advertise,
            bind_host=bind_host(advertise, local=local),
            world_size=self.world,
            timeout=self.cfg.store_timeout,
            new_session=_env.settings().agent is not None,  # see StoreProcess
            standby=standby,
        ).start()

    # barrier ------------------------------------------------------------------------------
    def barrier(
        self,
        n: int,
        *,
        leaving: str | None,
        fault: str | None,
        progress: bool = False,
        raised: str | None = None,
        probe: str | None = None,
    ) -> RoundLayout | None:
        """Round ``n``'s barrier (see :mod:`._book`); returns the published round (None for a
        leaving rank). ``fault``: this rank's fault that ended round ``n-1``, if it was the
        first; ``progress``: this rank made progress in round ``n-1``; ``raised``, ``probe``:
        see :class:`~._records.BarrierRecord`."""
        start = time.monotonic()
        raw = self.arrive(
            n, leaving=leaving, fault=fault, progress=progress, raised=raised, probe=probe
        )
        if leaving is not None:
            return None
        return self.take(n, raw, start)

    def arrive(
        self,
        n: int,
        *,
        leaving: str | None,
        fault: str | None,
        progress: bool = False,
        raised: str | None = None,
        probe: str | None = None,
    ) -> bytes | None:
        """The first half of :meth:`barrier`: this rank's record and its count (or its record
        handed to its node watcher, which arrives for it). Returns the published round when
        this call found or made it (it was the last arriver), else None (:meth:`take` waits
        for it)."""
        book = self.book
        assert book is not None
        record = self._record(leaving, fault, progress, raised, probe)
        if self._through_node(n, record, leaving):
            return None
        book.record(n, record)  # a notice's departure there first wins: the layout says so
        raw = book.arrive(n)
        if raw is None and leaving is None and self.relay is not None:
            self.relay.ask("ready", n)  # the relay waits for the layout while this rank does
        return raw

    def _through_node(self, n: int, record: BarrierRecord, leaving: str | None) -> bool:
        """Node arrival (:mod:`.sidecar._arrival`): hand round ``n``'s record to this rank's
        node watcher, which arrives for its ranks (True), and ask its relay for the layout.
        A leaving rank arrives itself (it does not wait for the layout, and its watch ends
        soon) and says so, so that its node does not wait for its record; False then, and
        when the watcher is gone (this rank arrives itself)."""
        node, relay = self.node, self.relay
        if node is None or relay is None:
            return False
        if leaving is not None:
            node.send({"arrive": n, "direct": 1})
            return False
        if not node.send({"arrive": n, "record": record.encode().decode()}):
            return False
        self._sent = (n, record)
        relay.ask("ready", n)
        return True

    def _arrive_again(self, n: int) -> bytes | None:
        """The relay failed while this rank waited for round ``n``'s layout: its watcher died,
        maybe before it arrived for this rank. Arrive at the store itself (a second arrival
        of the same record is harmless: the first counts, and the count only says when to
        look); the published round when this call made or found it."""
        sent, self._sent = self._sent, None
        if sent is None or sent[0] != n or self.book is None:
            return None
        self.book.record(n, sent[1])
        return self.book.arrive(n)

    def take(self, n: int, raw: bytes | None, start: float) -> RoundLayout:
        """The second half of :meth:`barrier`: wait for round ``n``'s layout unless ``raw``
        is it, read it, follow it (``start``: when this rank arrived, for the event)."""
        book = self.book
        assert book is not None
        last = raw is not None
        what, timeout = f"round {n} barrier", self.cfg.barrier_timeout
        relay = self.relay
        if raw is None and relay is not None:
            try:
                raw = relay.wait("ready", n, timeout)
            except CoordinationError as exc:
                self._unrelay(exc)
                timeout = max(0.0, start + timeout - time.monotonic())
            else:
                if raw is None:
                    raise barrier.late(what, timeout)
        if raw is None and self.relay is None:  # the watcher is gone (here or meanwhile)
            raw = self._arrive_again(n)
        if raw is None:  # on the monitor's connection, idle between rounds (see watch)
            raw = barrier.wait_key(self._watch_store(), self.keys.ready(n), timeout, what=what)
        waited = time.monotonic() - start
        ready = _records.layout(raw)
        if self.irank in ready.gone:  # declared gone after it arrived
            self._declared_gone(n, ready.gone[self.irank])
        events.emit("barrier", duration=waited, round_=n, last=last)
        book.enter(ready)
        return ready

    def join(self, notify: Notify | None) -> tuple[int, RoundLayout] | None:
        """A newcomer's way in (:mod:`._join`), instead of round 0's barrier: the first
        round it is laid out in and its layout; None when the job completed first.
        ``notify(round, roster)``: tells this rank's sidecar where it waits."""
        book = self.book
        assert book is not None
        if self.over:
            return None
        start = time.monotonic()
        newcomer = Newcomer(
            book,
            self._record(None, None, False),
            barrier_timeout=self.cfg.barrier_timeout,
            notify=notify,
        )
        joined = newcomer.join()
        if joined is None:
            return None
        n, ready = joined
        waited = time.monotonic() - start
        if self.irank in ready.gone:  # declared gone after it arrived
            self._declared_gone(n, ready.gone[self.irank])
        events.set_context(round=n)
        events.emit(
            "launch_admitted", duration=waited, incarnation=self.launch.incarnation, waited=waited
        )
        book.enter(ready)
        return joined

    def _record(
        self,
        leaving: str | None,
        fault: str | None,
        progress: bool,
        raised: str | None = None,
        probe: str | None = None,
    ) -> BarrierRecord:
        return BarrierRecord(
            rank=self.irank,
            host=self.host,
            local_rank=self.launch.local_rank,
            leave=leaving,
            fault=fault,
            progress=progress,
            raised=raised,
            probe=probe,
        )

    def _declared_gone(self, n: int, why: str | None) -> None:
        self.left = True  # whoever declared it gone counted it out of the job
        raise RestartError(
            f"rank {self.irank} was declared gone at round {n}'s barrier "
            f"({why or 'declared gone'}); it cannot rejoin: raise heartbeat_timeout if it was "
            "only slow"
        )

    # round outcome -------------------------------------------------------------------------
    def complete(self, n: int, active: int) -> None:
        """Count this rank's function as returned; the last one marks the round complete."""
        assert self.book is not None, "the session is not open"
        self.book.complete(n, active)

    def stop(self, n: int, outcome: RoundOutcome) -> bool:
        """Propose ``outcome`` for round ``n``; True if it was the first (it wins)."""
        assert self.book is not None, "the session is not open"
        return self.book.propose(n, outcome)

    # leaving -------------------------------------------------------------------------------
    def leave(self) -> None:
        """This rank leaves the job; the last to leave lets the store process exit."""
        if self.left or self.book is None or self.over:
            return
        self.left = True
        try:
            self.book.count_out(self.irank)
        except Exception as exc:
            logger.warning("could not record this rank's exit in the store: %s", exc)

    def close(self, *, early: bool, timeout: float) -> None:
        """Drop the store clients; on rank 0 wait for the store process to exit.

        ``early``: this rank left while the others go on; its store process keeps serving
        them and exits on its own when the job ends (it is not waited for, so it outlives
        this call). Otherwise it is waited for up to ``timeout`` seconds, then killed.
        """
        self.watch_store = self.relay = self.node = None
        self.book = None
        if self.secret is not None:
            if early:  # the job goes on: a newcomer may still need the secret's file
                self.secret.file = None
            self.secret.close()
        for server in (self.server, self.standby):
            if server is None:
                continue
            if not early:
                server.close(timeout=timeout)
            elif not server.join(0.0):
                _detached.append(server)
        self.server = self.standby = None
