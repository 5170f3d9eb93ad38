"""How the monitor thread interrupts the main thread.

Two steps: :func:`raise_in` schedules :class:`RestartInterrupt` in the main thread
(``PyThreadState_SetAsyncExc``: raised at its next bytecode), and :meth:`Kick.send` sends it
SIGUSR2 so that a blocking call (``time.sleep``, a wait on a lock) returns to run Python code,
where the interrupt is raised. The kick needs a handler, installed for the wrapped call by
:meth:`Kick.install` (only possible from the main thread) and removed by :meth:`Kick.restore`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from trainguard.restart.state import RestartInterrupt

#: a signal handler as ``signal.signal`` returns it.
Handler = Callable[[int, FrameType | None], object] | int | None


def raise_in(thread_id: int) -> bool:
    """Schedule a RestartInterrupt in ``thread_id``; True when it was scheduled."""
    return _set_async_exc(thread_id, RestartInterrupt) == 1


def importing(thread_id: int) -> bool:
    """True while ``thread_id`` runs an import (importlib's bootstrap frames on its stack)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def in_torch_distributed(thread_id: int) -> bool:
    """True when ``thread_id`` runs torch.distributed's Python code at its innermost frame.

    A thread seen there while another thread holds the GIL is inside a collective, a barrier
    or a rendezvous: it waits in C++ (``work.wait()``, a store wait), where an interrupt cannot
    land until the abort releases it. (A thread that waits for the GIL instead raises a
    pending interrupt as soon as it has it, before it starts anything new.)
    """
    dist = sys.modules.get("torch.distributed")
    where = getattr(dist, "__file__", None)
    frame = sys._current_frames().get(thread_id)
    if not where or frame is None:
        return False
    root = os.path.dirname(where) + os.sep
    return frame.f_code.co_filename.startswith(root)


def wait_out_of_imports(thread_id: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``thread_id`` to finish the import it runs.

    An interrupt raised inside a module's top-level code leaves that module half-initialized
    for the rest of the process (torch's lazy imports then fail at every later round).
    """
    deadline = time.monotonic() + timeout
    while importing(thread_id) and time.monotonic() < deadline:
        time.sleep(0.002)


def cancel_in(thread_id: int) -> None:
    """Withdraw a scheduled interrupt that was not raised yet."""
    _set_async_exc(thread_id, None)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    return int(
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
        )
    )


def _noop(signum: int, frame: FrameType | None) -> None:
    """Runs Python code in the main thread so that a pending restart interrupt is raised."""


class Kick:
    """SIGUSR2 to wake the main thread from a blocking call, while the wrapped call runs.

    :meth:`install` returns None when this is not the main thread (no handler can be set:
    the interrupt then lands when the blocking call returns on its own).
    """

    def __init__(self, previous: Handler) -> None:
        self._previous = previous

    @classmethod
    def install(cls) -> Kick | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        return cls(signal.signal(signal.SIGUSR2, _noop))

    def restore(self) -> None:
        previous = self._previous
        signal.signal(signal.SIGUSR2, previous if previous is not None else signal.SIG_DFL)

    @staticmethod
    def send(thread_id: int) -> None:
        signal.pthread_kill(thread_id, signal.SIGUSR2)
