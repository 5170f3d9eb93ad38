"""The agent's signals: none is lost, and only one from outside is a preemption.

torch's process context installs its handler for ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (SIGTERM,
SIGINT, SIGHUP, SIGQUIT) each time it starts the workers; the handler raises
``SignalException`` at whatever bytecode the main thread runs. Two things go wrong with that
alone:

- ``SignalException`` is an ``Exception``: raised inside a store call that the agent wraps in
  ``except Exception`` (the coordination store is cut off: the fence decides), it is taken for
  a store failure and the signal is lost. And while the main thread waits in a C++ store call
  (up to the store timeout), Python runs no handler at all, so the workers would get the
  signal only when that call returns.
- torch's own shutdown calls ``_shutdown(SIGTERM)`` when the agent's run ends and when it stops
  the workers for a whole-job restart: a SIGTERM that nobody sent.

Protocol (:class:`SignalWatch`, one per agent; the agent's main thread unless said):

1. :meth:`~SignalWatch.install` right after each start of the workers: torch's handler is
   replaced by one that notes the first signal (:attr:`~SignalWatch.received`) and then raises
   torch's ``SignalException`` as torch's does. The first install also starts a thread that
   reads Python's signal wake-up descriptor: on a SIGTERM it calls ``forward`` at once (the
   agent signals its workers' process groups), whatever the main thread is waiting on.
2. :meth:`~SignalWatch.reraise` around each monitor tick and after a rendezvous: a signal
   that was noted but swallowed is raised again, so it ends the loop one tick late at most.
   (In the exit barrier the workers are done: a signal there only ends the wait.)
3. :meth:`~SignalWatch.preempted` decides what the agent's ``_shutdown`` is: a preemption only
   when a SIGTERM reached this process (from the scheduler, ``kill``, ``srun``), not for the
   SIGTERM that torch's shutdown passes by default.
4. :meth:`~SignalWatch.close` when the agent's run ends: torch's wake-up descriptor setting
   is restored, the thread ends, the descriptors are closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from torch.distributed.elastic.multiprocessing.api import SignalException

__all__ = ["SignalWatch"]

logger = logging.getLogger(__name__)

#: the signals torch's agent may handle (``--signals-to-handle`` picks among them)
HANDLED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_STOP = b"\0"  # no signal has number 0: the thread's stop byte


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class SignalWatch:
    """The agent's signal handling (see the module docstring).

    Args:
        forward: called on the watch's thread, once, when the first SIGTERM arrives: signal
            the workers (it must not raise; what it raises is logged).
    """

    def __init__(self, forward: Callable[[], None]) -> None:
        self.forward = forward
        #: the first signal this process received while the watch was installed, or None
        self.received: signal.Signals | None = None
        #: a SIGTERM reached this process (first or not)
        self.sigterm = False
        self._thread: threading.Thread | None = None
        self._fds: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._forwarded = threading.Event()

    # 1. install ----------------------------------------------------------------------------
    def install(self) -> None:
        """Replace torch's handler (main thread; elsewhere nothing changes)."""
        if not _is_main_thread():
            return
        for sig in HANDLED:
            current = signal.getsignal(sig)
            if callable(current) and current != self._on_signal:
                signal.signal(sig, self._on_signal)
        if self._thread is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._fds = (read, write)
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._thread = threading.Thread(
                target=self._watch, name="trainguard-agent-signals", daemon=True
            )
            self._thread.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
        self.sigterm = self.sigterm or sig == signal.SIGTERM
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    def _watch(self) -> None:
        assert self._fds is not None
        read = self._fds[0]
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data or _STOP in data:
                return
            if signal.SIGTERM in data and not self._forwarded.is_set():
                self._forwarded.set()
                try:
                    self.forward()
                except Exception:
                    logger.exception("could not forward the SIGTERM to the workers")

    # 2. reraise ----------------------------------------------------------------------------
    def reraise(self) -> None:
        """Raise the signal noted again (it was swallowed: the agent's loop runs on). Only
        the loop calls it; once torch's ``run()`` took the signal the loop is over."""
        sig = self.received
        if sig is not None:
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    # 3. what a shutdown is ------------------------------------------------------------------
    def preempted(self) -> bool:
        """True when a SIGTERM reached this process, so the agent's shutdown is a preemption
        (its workers got it too); torch's own shutdowns pass SIGTERM with no signal received."""
        return self.sigterm

    # 4. close -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread and restore the wake-up descriptor (main thread)."""
        thread, fds = self._thread, self._fds
        self._thread = self._fds = None
        if thread is None or fds is None:
            return
        if _is_main_thread():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._old_wakeup)
        with contextlib.suppress(OSError):
            os.write(fds[1], _STOP)
        thread.join(5.0)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
