"""Save on preemption: a SIGTERM stops every rank at one agreed step, which is saved, and the
job exits with a status a scheduler requeues.

Protocol (the Wrapper and the wrapped function; every active rank does the same):

1. For the call, the Wrapper installs a SIGTERM handler in the main thread (the previous one
   is restored when the call ends). The handler only notes the signal: the grace budget
   (``Wrapper(preemption_grace=...)``, ``TRAINGUARD_PREEMPTION_GRACE``, default 60 s) starts
   then. A SIGTERM that reaches a process whose function ran but never called
   :meth:`~trainguard.restart.CallWrapper.preempted` ends it at once, as without the handler
   (a spare that never ran it notes the signal and ends with the others, or at the budget).
2. At every step boundary the function calls ``call.preempted(step)``, ``step`` being the
   number of steps completed (the step it is about to run). A rank that noticed the signal
   and finds no stop step in the coordination store proposes ``step + 1`` (compare-and-set:
   the first proposal wins; +1 because a rank that checked before the proposal may already be
   inside step ``step``, waiting for this one in a collective). Every rank reads the stop
   step (one store round trip per call) and gets True at that boundary: a rank that did not
   see the signal learns it there. The stop step lives under the call's keyspace, with the
   job secret (:attr:`~trainguard.coord.Keyspace.preempt_stop`): nobody who reaches a store
   without the secret can forge it, and it is the call's, not a round's, so a fault that
   starts a new round before every rank read it changes nothing (every rank reads it there,
   none proposes another).
3. On True the function saves the state of ``step`` completed steps (a local and a durable
   checkpoint), waits for both within :meth:`~trainguard.restart.CallWrapper.grace_left`
   and returns.
4. When the call ends and this process was preempted, the wrapped function raises
   :class:`Preempted` (a ``SystemExit`` with status :data:`EXIT_PREEMPTED`, 75) instead of
   returning: the process exits with the status ``trainguard launch`` passes on and a
   scheduler requeues (see ``docs/preemption.md``). The next start resumes from the step saved.
5. Budget: if the call has not ended ``grace`` seconds after the signal, this process logs what
   was lost (the step, and which ranks had not finished saving it) and exits with status 75 at
   once: the newest committed checkpoint, older, stays the latest. An exception in the
   function after the stop was agreed (a failed save) ends the job the same way, without a
   restart round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainguard import events
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike
from trainguard.restart.state import RoundOutcome, RoundState

__all__ = ["EXIT_PREEMPTED", "Preempted", "Preemption"]

logger = logging.getLogger(__name__)

#: exit status of a process (and of ``trainguard launch``) stopped by a preemption: EX_TEMPFAIL,
#: "try again later"; a scheduler requeues the job on it (``docs/preemption.md``).
EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """Raised by a wrapped function whose job was preempted (SIGTERM), once the call ended.

    A ``SystemExit`` with code :data:`EXIT_PREEMPTED`: uncaught, the process exits with the
    status a scheduler requeues on, after the ``finally`` blocks around the call ran (close
    the checkpointers there). ``step`` is the step the job stopped at (None when it stopped
    before any rank reached a step boundary); ``saved`` whether this rank's function returned
    after saving it.
    """

    def __init__(self, step: int | None, saved: bool) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step
        self.saved = saved

    def __reduce__(self) -> tuple[type[Preempted], tuple[int | None, bool]]:
        return type(self), (self.step, self.saved)


class Preemption:
    """One wrapped call's side of the protocol above (built by the Wrapper, one per call).

    Args:
        grace: the budget, in seconds, from the SIGTERM to the end of the call.
        rank: this process's initial rank.

    :meth:`bind` gives it the coordination store once the call's session is open, before the
    first round.
    """

    def __init__(self, grace: float, rank: int) -> None:
        self.grace = grace
        self.rank = rank
        self.noticed: float | None = None  # time.monotonic() of the first SIGTERM
        self.stop_step: int | None = None  # the agreed step, once this rank read it
        self.aware = False  # the function called preempted() at least once
        self.ran = False  # this process ran the function (it was active in a round)
        self.done = False  # the function returned after the stop (its save is done)
        self._store: StoreLike | None = None  # the coordination store (bind)
        self._keys: Keyspace | None = None  # the call's keyspace, with the job secret
        self._clone: Callable[[], StoreLike] | None = None  # a connection of the caller's own
        self._ranks: tuple[int, ...] = ()  # initial ranks of the round's active ranks
        self._previous: Any = None
        self._installed = False  # our handler is SIGTERM's now
        self._owned = False  # between install() and uninstall()
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._reported = False  # the loss was logged

    # the handler ---------------------------------------------------------------------------
    def install(self) -> None:
        """Handle SIGTERM for the call (only the main thread can; elsewhere nothing changes)."""
        if not _main_thread():
            logger.debug("not the main thread: SIGTERM keeps its handler (no preemption save)")
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = self._owned = True

    def enter(self) -> None:
        """Main thread, the function starts on this rank (each round): until it calls
        ``preempted`` (it may never), SIGTERM keeps its previous action (the default kills the
        process even while a thread holds the GIL, e.g. the sidecar's kill at the hard
        timeout). A save of the stop step in an earlier round counts no more."""
        self.ran = True
        if self.done:  # saved in a round that then faulted: this round saves again
            self.done = False
            if self._store is not None and self._keys is not None:
                with contextlib.suppress(Exception):
                    self._store.delete_key(self._keys.preempt_done(self.rank))
        if self._installed and not self.aware:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _aware(self) -> None:
        """The function called ``preempted``: SIGTERM is a preemption from now on."""
        self.aware = True
        if self._owned and not self._installed and _main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True

    def uninstall(self) -> None:
        """Restore the previous handler; stop the budget's timer unless this process was
        preempted (then the budget bounds what follows the call too: the process ends by then)."""
        with self._lock:
            timer = None if self.signalled else self._timer
            if timer is not None:
                self._timer = None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        self._owned = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.ran and not self.aware:
            # a function that never asks cannot stop at a step (the signal may also be the
            # sidecar's kill at the hard timeout): end as without trainguard
            self.uninstall()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.noticed is not None:
            return
        self.noticed = time.monotonic()
        logger.warning(
            "rank %d: SIGTERM: preemption; stopping at the next agreed step (grace %g s)",
            self.rank,
            self.grace,
        )
        events.emit("preempt_signal", grace=self.grace)
        timer = threading.Timer(self.grace, self._expired)
        timer.name = "tg-preempt-budget"
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    @property
    def signalled(self) -> bool:
        """True once this process got SIGTERM or learned the stop step from the store."""
        return self.noticed is not None or self.stop_step is not None

    def grace_left(self) -> float | None:
        """Seconds left of the budget (None: no SIGTERM noticed by this process)."""
        if self.noticed is None:
            return None
        return max(0.0, self.noticed + self.grace - time.monotonic())

    # the step boundary ---------------------------------------------------------------------
    def bind(self, store: StoreLike, keys: Keyspace, clone: Callable[[], StoreLike]) -> None:
        """Main thread, once the session is open: ``store`` is this rank's connection to the
        coordination store (shared with other threads: short operations only), ``keys`` the
        call's keyspace with the job secret, ``clone`` makes a connection of the caller's own
        (the budget's timer thread)."""
        self._store, self._keys, self._clone = store, keys, clone

    def check(self, step: int, state: RoundState) -> bool:
        """``call.preempted(step)`` on an active rank of the round ``state`` describes: True
        when the job stops before ``step`` (see above)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            from trainguard.errors import ConfigError

            raise ConfigError(
                f"call.preempted(step={step!r}): pass the number of steps completed (an int >= 0)"
            )
        store, keys = self._store, self._keys
        assert store is not None and keys is not None, "bind() comes before the first round"
        if not self.aware:
            self._aware()
        self._ranks = state.active_ranks
        if self.stop_step is None:
            key = keys.preempt_stop
            if store.check([key]):
                self.stop_step = _read_step(store.get(key))
            elif self.noticed is not None:
                wanted = str(step + 1).encode()
                self.stop_step = _read_step(store.compare_set(key, b"", wanted))
                if self.stop_step == step + 1:
                    logger.info(
                        "rank %d: proposed the preemption stop at step %d", self.rank, step + 1
                    )
            if self.stop_step is None:
                return False
            if self.noticed is None:  # learned from the store: the budget counts from now
                self.noticed = time.monotonic()
        if step < self.stop_step:
            return False
        if step > self.stop_step:
            logger.error(
                "rank %d: at step %d, past the agreed preemption step %d (it runs ahead of "
                "the others without a collective per step); saving step %d",
                self.rank,
                step,
                self.stop_step,
                step,
            )
        events.emit("preempt_stop", step=step)
        return True

    def returned(self) -> None:
        """The active function returned: once the stop was agreed, its save is done."""
        if self.stop_step is None or self._store is None or self._keys is None:
            return
        self.done = True
        with contextlib.suppress(Exception):
            self._store.set(self._keys.preempt_done(self.rank), b"1")

    def failed(self, error: str) -> RoundOutcome | None:
        """The function raised ``error``: after the stop was agreed, the round's outcome that
        ends the job (its save failed; restarting would lose the budget); else None."""
        if self.stop_step is None:
            return None
        reason = f"failed while saving the preemption step {self.stop_step}"
        self._lost(f"rank {self.rank} {reason} ({error}){self._late()}")
        return RoundOutcome.end(reason, rank=self.rank, error=error)

    def outcome(self) -> Preempted:
        """What the wrapped function raises when the call ended preempted."""
        if self.stop_step is not None and not self.done:
            self._lost(
                f"rank {self.rank} was late: it had not finished saving step {self.stop_step}"
            )
        else:
            logger.warning(
                "rank %d: preempted%s; exiting with status %d (requeue the job to resume)",
                self.rank,
                f", step {self.stop_step} saved" if self.stop_step is not None else "",
                EXIT_PREEMPTED,
            )
        return Preempted(self.stop_step, self.done)

    # the budget ----------------------------------------------------------------------------
    def _expired(self) -> None:
        """Timer thread: the budget ran out before the process ended; log the loss and exit."""
        step = self.stop_step
        if step is None:
            what = "no rank reached the agreed stop step"
        elif self.done:
            what = f"rank {self.rank} saved step {step}, not every rank did{self._late()}"
        else:
            what = f"rank {self.rank} was late: it had not finished saving step {step}"
        self._lost(f"the grace budget of {self.grace:g} s ran out: {what}")
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)

    def _lost(self, what: str) -> None:
        """Log (and emit) that the stop step is lost."""
        if self._reported:
            return
        self._reported = True
        step = self.stop_step
        logger.error(
            "rank %d: preemption: %s; step %s is lost, the newest committed checkpoint stays "
            "the latest; exiting with status %d",
            self.rank,
            what,
            step,
            EXIT_PREEMPTED,
        )
        events.emit("preempt_lost", step=step, why=what)

    def _late(self) -> str:
        """`` (ranks not done: ...)``: the (initial) ranks of the round that had not saved the
        stop step, as the store has it; nothing when it cannot be read."""
        clone, keys = self._clone, self._keys
        if clone is None or keys is None:
            return ""
        with contextlib.suppress(Exception):
            client: Any = clone()  # this thread's own connection (a torch store here)
            client.set_timeout(_seconds(2))
            late = [r for r in self._ranks if not client.check([keys.preempt_done(r)])]
            return f" (ranks not done: {late})" if late else ""
        return ""


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


def _read_step(raw: bytes | str) -> int:
    """The stop step from the store, validated."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if not (text.isascii() and text.isdigit()):
        from trainguard.errors import CoordinationError

        raise CoordinationError(
            f"the preemption stop step in the store is {text[:40]!r}, not a step number; "
            "another program writes the job's keys: give each job its own store"
        )
    return int(text)
