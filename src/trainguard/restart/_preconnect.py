"""Connecting to the next round's store ahead of time, off the restart's critical path.

A new TCPStore client costs a name lookup and a TCP connect, and torch 2.13 also writes the
peer's address down with a reverse lookup (``getnameinfo`` without ``NI_NUMERICHOST``) at every
connect: where the resolver has no answer for the address (the IPv4-mapped loopback address
that an IPv6 socket reaches 127.0.0.1 by, on a machine with a DNS server configured), that is a
DNS query that can wait out its whole timeout, 5 s. Made by every rank at every round's
``init_process_group``, such stalls were the tail of fault -> first collective.

The store process opens round ``n+1``'s store before round ``n`` starts
(:mod:`trainguard.coord._server`), so its address is known while round ``n`` runs. Protocol (one
:class:`Preconnect` per wrapped call, driven by the main thread):

1. Round ``n`` starts: :meth:`Preconnect.ahead` ``(n + 1)``. The call's worker thread reads round
   ``n+1``'s address on a coordination connection of its own and connects a client to it (the
   lookups and any stall happen there, while round ``n`` trains). That connection may appear
   while the main thread builds a process group, so it is marked as no group's
   (:meth:`GroupSockets.exclude_peer <trainguard.restart.abort.GroupSockets.exclude_peer>`
   before it connects, ``settle_peer`` after): the abort of round ``n`` must not shut it down.
2. In round ``n+1`` a plain ``init_process_group(backend)`` (``env://`` or ``tcp://``: torch
   makes their store in ``torch.distributed.rendezvous._create_c10d_store``, which
   :meth:`Preconnect.install` replaces while the wrapper runs) and ``call.store`` take that
   client with :func:`claim` instead of connecting. The first taker gets it (waiting for a
   connect still under way, never past that connect's bound), later ones connect as before;
   another address is never touched.
3. Round ``n+1`` is over: :meth:`Preconnect.forget` drops a client nobody took;
   :meth:`Preconnect.close` stops the thread and drops everything.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from trainguard._threads import serve
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike, connect, parse_addr, probe
from trainguard.restart._book import peek
from trainguard.restart.abort import GroupSockets, note_rendezvous

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["Preconnect", "claim"]

logger = logging.getLogger(__name__)

_PROBE_S = 1.0  # a probe of the next round's store before connecting a client to it
#: at most this long for a client made ahead (above a stalled reverse lookup, 5 s); a
#: round whose client is not ready connects as usual, and the call's end waits no longer
_CONNECT_S = 8.0


#: a taker waits this much past the connect's own bound (_CONNECT_S) before it gives up on it
_CLAIM_SLACK_S = 0.5


@dataclasses.dataclass
class _Slot:
    round: int
    owner: Preconnect
    #: when a taker stops waiting for this connect (time.monotonic): the connect's bound
    deadline: float = dataclasses.field(
        default_factory=lambda: time.monotonic() + _CONNECT_S + _CLAIM_SLACK_S
    )
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    store: StoreLike | None = None


_lock = threading.Lock()
_slots: dict[tuple[str, int], _Slot] = {}  # (host, port) as published -> its client
_users = 0
_original: Callable[..., Any] | None = None


def _rendezvous() -> Any:
    """The module ``torch.distributed.rendezvous`` (the package's attribute of that name is a
    function)."""
    return importlib.import_module("torch.distributed.rendezvous")


def claim(host: str, port: int, timeout: float) -> StoreLike | None:
    """The client connected ahead of time to ``host:port``, or None (connect as usual).

    Waits up to ``timeout`` seconds for a connect that is still under way, and never past
    that connect's own bound (:data:`_CONNECT_S` from its start): torch's client can hang
    past its timeout (something that is not a store answers on the port, a reverse lookup
    stalls), and the round must not wait on it for the group's whole timeout (the watchdog
    would take it for a hang and restart the round). A connect given up on is the caller's
    no longer: its client is dropped when it returns. Each client is handed out once."""
    with _lock:
        slot = _slots.get((host, port))
    if slot is None:
        return None
    bound = max(0.0, min(timeout, slot.deadline - time.monotonic()))
    done = slot.done.wait(bound)
    with _lock:
        if _slots.get((host, port)) is not slot:
            return None  # taken meanwhile
        del _slots[(host, port)]  # taken, or given up on: a late client is dropped
    if not done:
        logger.warning(
            "the client of %s:%d connected ahead of time was not ready within %.1f s; "
            "connecting as usual",
            host,
            port,
            bound,
        )
        return None
    return slot.store


def _create_c10d_store(
    hostname: str, port: int, rank: int, world_size: int, timeout: Any, use_libuv: bool = True
) -> Any:
    """torch's ``_create_c10d_store`` that takes a client connected ahead of time when every
    rank is a client (``TORCHELASTIC_USE_AGENT_STORE``, which the wrapper sets)."""
    rdzv = _rendezvous()
    original = _original if _original is not None else rdzv._create_c10d_store
    note_rendezvous(time.monotonic())
    try:
        if rdzv._torchelastic_use_agent_store():
            store = claim(hostname, port, timeout.total_seconds())
            if store is not None:  # a rank's clients are torch's (see StoreLike)
                cast("Store", store).set_timeout(timeout)
                return store
        return original(hostname, port, rank, world_size, timeout, use_libuv)
    except BaseException:
        note_rendezvous(None)
        raise


class Preconnect:
    """Clients of the next rounds' stores, connected by a worker thread; see the module docstring.

    Args:
        coord: a coordination store connection (the wrapper shares its own: the worker thread
            only reads, never waits on it).
        keys: the call's keyspace.
        timeout: the connect timeout in seconds.
    """

    def __init__(self, coord: StoreLike, keys: Keyspace, *, timeout: float) -> None:
        self._coord: StoreLike | None = coord
        self._keys = keys
        self._timeout = timeout
        self._jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._newest = -1  # the newest round asked for: older asks still queued are stale
        self._thread = threading.Thread(
            target=serve, args=(self._jobs, self._connect), name="trainguard-preconnect"
        )
        self._thread.daemon = True
        self._thread.start()

    @staticmethod
    def install() -> None:
        """Let ``init_process_group``'s rendezvous take pre-connected clients (nests)."""
        global _users, _original
        rdzv = _rendezvous()
        with _lock:
            _users += 1
            if _users == 1:
                _original = rdzv._create_c10d_store
                rdzv._create_c10d_store = _create_c10d_store

    @staticmethod
    def uninstall() -> None:
        global _users, _original
        rdzv = _rendezvous()
        with _lock:
            _users -= 1
            if _users == 0 and _original is not None:
                rdzv._create_c10d_store = _original
                _original = None

    def ahead(self, n: int) -> None:
        """Connect to round ``n``'s store in the background (returns at once)."""
        self._newest = max(self._newest, n)
        self._jobs.put(n)

    def forget(self, n: int) -> None:
        """Drop this call's clients of rounds up to ``n`` that nobody took."""
        self._drop(lambda slot: slot.round <= n)

    def close(self, timeout: float) -> None:
        """Stop the worker thread (waits up to ``timeout`` s for a connect under way), drop all."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the pre-connect thread did not stop within %.1f s", timeout)
        self._drop(lambda slot: True)
        self._coord = None

    def _drop(self, which: Callable[[_Slot], bool]) -> None:
        with _lock:
            gone = [a for a, s in _slots.items() if s.owner is self and which(s)]
            slots = [_slots.pop(a) for a in gone]
        for slot in slots:
            slot.store = None  # closes the connection

    # worker thread ------------------------------------------------------------------------
    def _connect(self, n: int) -> None:
        coord = self._coord
        if coord is None:
            return  # closed
        try:
            raw = peek(coord, self._keys.pg_addr(n))
        except Exception as exc:
            logger.debug("round %d's store address could not be read: %s", n, exc)
            return
        if raw is None:
            return  # not published (the job is ending): that round connects as usual
        addr = parse_addr(raw.decode())
        if n < self._newest or probe(*addr, _PROBE_S) != "up":
            # a later round is asked for, or this one's store is closed already (rounds that
            # fault at once pass faster than connects): a client would only wait out its timeout
            return
        slot = _Slot(n, self)
        with _lock:
            _slots[addr] = slot
        # made while the main thread may be building a group: it is no group's socket (the
        # round's own abort shuts it down by address: WrappedCall._aborted)
        GroupSockets.exclude_peer(*addr)
        try:
            slot.store = connect(*addr, timeout=min(self._timeout, _CONNECT_S))
        except Exception as exc:
            logger.debug("pre-connecting to round %d's store failed: %s", n, exc)
            with _lock:
                if _slots.get(addr) is slot:
                    del _slots[addr]
        finally:
            GroupSockets.settle_peer(*addr)
            slot.done.set()
