"""The monitor thread: wakes on a round's outcome, aborts, and interrupts the main thread.

One monitor per wrapped call, on its own store connection (``Store.clone()``) or reading the
outcomes through the node watcher's relay (``source``). Protocol, per
round ``n`` (driven by the main thread):

1. The main thread calls :meth:`Monitor.watch` with ``n``; the monitor blocks in
   ``wait([stop(n)])`` (or in its source): no polling, it wakes within one store round trip
   of the outcome (plus one local message through a relay).
2. Outcome ``complete``: nothing to do. Outcome ``fault`` or ``end``: the monitor waits for
   any :meth:`atomic` section to finish; if the main thread is inside the function, raises
   :class:`RestartInterrupt` in it (:mod:`._interrupt`) and gives it a moment (``settle_s``)
   to leave (not when it is blocked in a collective; see :meth:`Monitor._interrupt_first`);
   then aborts torch.distributed (:mod:`.abort`) and calls
   :attr:`MonitorHooks.aborted` (the user's ``abort`` hook). The interrupt comes first so that a main thread running Python code does
   not start a collective while the abort tears the group down (see
   :meth:`Monitor._interrupt_first`); it is never raised while the main thread runs an
   import (it waits for the import to end, up to ``abort_timeout``). A round is aborted at
   most once, whatever happens afterwards.
3. A main thread that does not leave the function within ``abort_timeout`` of the abort is
   reported to :attr:`MonitorHooks.stuck` (that rank then leaves the job); one in the bounded
   connect phase of a group's constructor (:mod:`._setup`) is given until that phase ends.
4. The main thread collects the outcome with :meth:`wait_outcome` before it goes on, so the
   monitor never acts on a round the main thread has left.

The main thread tells the monitor where it is with :meth:`Monitor.enter_fn` /
:meth:`Monitor.leave_fn` (read back as :attr:`Monitor.in_function`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator

from trainguard import events
from trainguard._threads import serve
from trainguard.coord.barrier import wait_forever
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike
from trainguard.restart._book import propose
from trainguard.restart._interrupt import (
    cancel_in,
    in_torch_distributed,
    raise_in,
    wait_out_of_imports,
)
from trainguard.restart._setup import connecting_until
from trainguard.restart.abort import abort_distributed
from trainguard.restart.state import RestartInterrupt, RoundOutcome

__all__ = ["Monitor", "MonitorHooks"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MonitorHooks:
    """What the monitor thread calls back into (each optional).

    Attributes:
        aborted: ``(round, outcome)`` after torch.distributed was aborted (the user's
            ``abort`` hook); its exceptions are logged, never raised.
        stuck: ``(round)`` when the main thread did not leave the function within
            ``abort_timeout`` of the abort.
        kick: ``(thread id)`` wakes the main thread from a blocking call so that the
            interrupt is raised (:class:`~trainguard.restart._interrupt.Kick`).
    """

    aborted: Callable[[int, RoundOutcome], None] | None = None
    stuck: Callable[[int], None] | None = None
    kick: Callable[[int], None] | None = None


class Monitor:
    """Watches round outcomes for one wrapped call; see the module docstring.

    Args:
        store: a dedicated client connection (used by the monitor thread only).
        keys: the call's keyspace.
        thread_id: the thread that runs the wrapped function (:attr:`main_thread_id`).
        hooks: the calls back into the wrapper.
        abort_timeout: how long the main thread may take to leave the function after the
            abort before :attr:`MonitorHooks.stuck` is called.
        settle_s: how long the abort waits for an interrupted main thread to leave the
            function before it shuts the group's sockets down.
        collective_grace_s: the same wait for a main thread blocked in a collective (it
            leaves only when its peers' connections close: this is the delay it adds to the
            abort of a collective that waits on a hung rank).
        source: waits for round ``n``'s outcome and returns it (default: a wait for the
            outcome's key on ``store``; the wrapper passes the node watcher's relay when
            there is one, :meth:`~trainguard.restart._session.Session.outcome`). ``store``
            then only takes the write of :meth:`close`.
        setup_cap: a main thread in the bounded connect phase of a group's constructor
            (:func:`~trainguard.restart._setup.connecting_until`) is given until that phase
            ends plus ``abort_timeout``, at most this long after the abort's check starts
            (the others wait at the next barrier meanwhile); None: no such wait.
    """

    def __init__(
        self,
        store: StoreLike,
        keys: Keyspace,
        thread_id: int,
        *,
        hooks: MonitorHooks | None = None,
        abort_timeout: float = 5.0,
        settle_s: float = 0.02,
        collective_grace_s: float = 0.02,
        setup_cap: float | None = None,
        source: Callable[[int], bytes] | None = None,
    ) -> None:
        self._hooks = hooks or MonitorHooks()
        self.settle_s = settle_s
        self.collective_grace_s = collective_grace_s
        self._store = store
        self._keys = keys
        self._source = source or (lambda n: wait_forever(store, keys.stop(n)))
        self._tid = thread_id
        self._abort_timeout = abort_timeout
        self._setup_cap = setup_cap
        self._jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._atomic = 0
        self._in_fn = False
        self._injected = False
        self._watching: int | None = None
        self._outcome: RoundOutcome | None = None
        self._outcome_ready = threading.Event()
        self.aborted_round: int | None = None
        self._thread = threading.Thread(target=self._run, name="trainguard-monitor", daemon=True)
        self._thread.start()

    # main thread ------------------------------------------------------------------------
    def watch(self, n: int) -> None:
        """Start watching round ``n``'s outcome."""
        with self._lock:
            self._outcome = None
            self._outcome_ready.clear()
            self._injected = False
            self._watching = n
        self._jobs.put(n)

    def wait_outcome(self, timeout: float | None) -> RoundOutcome | None:
        """The outcome of the watched round, or None after ``timeout`` seconds.

        Waits in short slices so that a signal (Ctrl-C) is handled promptly.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outcome_ready.wait(0.5):
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return self._outcome

    @property
    def outcome(self) -> RoundOutcome | None:
        """The watched round's outcome once the monitor acted on it, else None."""
        return self._outcome if self._outcome_ready.is_set() else None

    @property
    def in_function(self) -> bool:
        """True while the main thread is inside the wrapped function."""
        return self._in_fn

    @property
    def main_thread_id(self) -> int:
        """The thread that runs the wrapped function."""
        return self._tid

    def enter_fn(self, n: int) -> None:
        """Mark the function as entered; raises RestartInterrupt if round ``n`` is aborted."""
        with self._lock:
            if self.aborted_round == n:
                raise RestartInterrupt()
            self._in_fn = True

    def leave_fn(self) -> None:
        """Mark the function as left; clears an interrupt that was raised but not delivered."""
        with self._lock:
            self._in_fn = False
            if self._injected:
                cancel_in(self._tid)
            self._cond.notify_all()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the monitor never interrupts: an abort waits until it ends."""
        with self._cond:
            self._atomic += 1
        try:
            yield
        finally:
            with self._cond:
                self._atomic -= 1
                self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; a round still watched is ended first so the wait returns."""
        with self._lock:
            n = self._watching if not self._outcome_ready.is_set() else None
        if n is not None:
            with contextlib.suppress(Exception):
                propose(self._store, self._keys, n, RoundOutcome.end("closed"))
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("monitor thread did not stop within %.1f s", timeout)

    # monitor thread ---------------------------------------------------------------------
    def _check_released(self, n: int) -> None:
        """Wait for the main thread to leave the function; escalate if it never does.

        gloo occasionally leaves a collective waiting although every connection of its group
        was shut down (a send waiting for its peer, seen with 8 ranks on 2 cores). Such a
        rank would hold every other rank at the next barrier; ``on_stuck`` takes it out of
        the job instead.
        """
        deadline = self._release_deadline()
        kick = self._hooks.kick
        if kick is not None:
            # A blocking call (time.sleep, a wait on a lock) holds the interrupt back until it
            # returns; a signal makes it run Python code in the main thread, which raises it.
            with self._cond:
                self._cond.wait_for(lambda: not (self._in_fn and self._injected), 0.05)
                if self._in_fn and self._injected:
                    with contextlib.suppress(Exception):
                        kick(self._tid)
        with self._cond:
            while self._in_fn and self._injected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            stuck = self._in_fn and self._injected
        if stuck and self._hooks.stuck is not None:
            self._hooks.stuck(n)

    def _release_deadline(self) -> float:
        """By when the main thread must have left the function: ``abort_timeout`` from now;
        for one in the bounded connect phase of a group's constructor (it cannot be released,
        but raises by the phase's end), that end plus ``abort_timeout``, within the cap."""
        now = time.monotonic()
        deadline = now + self._abort_timeout
        until = connecting_until(self._tid) if self._setup_cap is not None else None
        if until is not None and self._setup_cap is not None:
            deadline = max(deadline, min(until + self._abort_timeout, now + self._setup_cap))
        return deadline

    def _run(self) -> None:
        serve(self._jobs, self._watch_round)

    def _watch_round(self, n: int) -> None:
        try:
            outcome = RoundOutcome.decode(self._source(n))
        except Exception as exc:
            outcome = RoundOutcome.end(f"store lost: {exc}")
        seen = time.monotonic()
        if outcome.why != "complete" and self.aborted_round != n:
            try:
                self._abort(n, outcome, seen)
            except Exception:  # never leave the main thread waiting for the outcome
                logger.exception("aborting round %d failed", n)
        with self._lock:
            self._outcome = outcome
            self._watching = None
        self._outcome_ready.set()

    def _abort(self, n: int, outcome: RoundOutcome, seen: float) -> None:
        # The main thread may be running Python: hand the GIL over at once, not after the
        # default 5 ms switch interval at every system call of the abort.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            self._abort_round(n, outcome, seen)
        finally:
            sys.setswitchinterval(interval)

    def _interrupt_first(self) -> None:
        """Interrupt the main thread before the sockets go down, and let it leave.

        A main thread that runs Python code when the abort starts (between two collectives)
        could otherwise start its next collective while gloo is closing the shut-down
        connections: gloo then leaves that collective waiting for good although every
        connection of the group is closed (seen under load: the pairs' descriptors gone, the
        thread still in ``work.wait()``), and the interrupt cannot land in that C++ wait.
        Raised first, the interrupt lands before the collective starts. A main thread that
        is already blocked in a collective (its innermost frame is torch.distributed's, see
        :func:`~trainguard.restart._interrupt.in_torch_distributed`) is not kicked, but it is
        waited for too: when a rank raised, its peers' collectives usually fail on their own a
        moment later (the faulted rank's connections close). Shutting down the group's sockets
        on every rank at once instead races gloo: a send that gloo writes after the peer's
        socket was reset is queued and never woken when the pair fails, and the collective then
        blocks until the group's timeout (seen about once in 100 aborted rounds). The wait ends
        as soon as the main thread has left the function (an event), :attr:`settle_s` at most
        (a long C++ call such as a backward pass), :attr:`collective_grace_s` for a collective
        (one that waits on a hung peer leaves only after the shutdown).
        """
        if self._in_fn:  # never inside an import (a module half-imported stays broken)
            wait_out_of_imports(self._tid, self._abort_timeout)
        with self._lock:
            if not self._in_fn:
                return
            self._injected = raise_in(self._tid)
            if not self._injected:
                return
        wait = self.settle_s
        if in_torch_distributed(self._tid):
            wait = self.collective_grace_s  # a kick cannot reach a thread waiting in C++
        elif self._hooks.kick is not None:
            with contextlib.suppress(Exception):
                self._hooks.kick(self._tid)
        with self._cond:
            self._cond.wait_for(lambda: not self._in_fn, wait)

    def _abort_round(self, n: int, outcome: RoundOutcome, seen: float) -> None:
        with self._lock:
            self.aborted_round = n
        start = time.monotonic()
        with self._cond:
            while self._atomic:
                self._cond.wait()
        self._interrupt_first()
        info = abort_distributed()
        if self._hooks.aborted is not None:
            try:
                self._hooks.aborted(n, outcome)
            except Exception:
                logger.exception("the abort hook raised (ignored)")
        if self._in_fn and not self._injected:
            wait_out_of_imports(self._tid, self._abort_timeout)
        with self._lock:
            if self._in_fn and not self._injected:
                self._injected = raise_in(self._tid)
        self._check_released(n)
        events.emit(
            "abort",
            duration=time.monotonic() - start,
            cause=outcome.why,
            fault_rank=outcome.rank,
            interrupted=self._injected,
            sockets=info.get("sockets"),
            shutdown_s=info.get("shutdown_s"),
            destroy_s=info.get("destroy_s"),
            waited_s=start - seen,
        )
