"""The progress watchdog thread: soft timeout, heartbeat lines to the helper, its loss.

Every ``interval`` seconds the thread:

1. looks at the main thread's innermost frame and instruction offset
   (``sys._current_frames()``); a change is progress, and so is a ``call.ping()`` (a loop
   that spends its steps waiting at one place, such as a GPU synchronisation, pings). The training loop pays nothing: no
   hook runs in it, the thread only takes the GIL for a few microseconds per sample.
2. when the function pinged at least once (``call.ping()``), also requires a ping within
   ``soft_timeout`` (a loop in Python code moves the frame but not the pings).
3. past ``soft_timeout`` without progress inside the function, records a fault for the round
   (the monitors of every rank then abort and restart it, this rank's included), from a
   short-lived thread so that a slow store never delays step 4.
4. sends ``{"hb", "in_fn", "stall"}`` to the rank's helper (the node watcher or the
   launcher's agent); a thread that holds the GIL stops these lines, which is how the helper
   sees a hard hang.
5. checks that the helper is alive; when it is not, it records a fault and ``lost`` says
   why (the wrapper then takes this rank out of the job: it must not run unprotected).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainguard import events

__all__ = ["Watchdog"]

logger = logging.getLogger(__name__)


class Watchdog:
    """See the module docstring.

    Args:
        thread_id: the thread that runs the wrapped function.
        state: ``() -> (round, in_fn, call)`` read at each sample (call may be None).
        on_hang: ``(round, description) -> None``: record the fault.
        sidecar: the rank's helper handle (:class:`~trainguard.restart._helper.HelperHandle`), or
            None.
    """

    def __init__(
        self,
        *,
        thread_id: int,
        state: Callable[[], tuple[int, bool, Any]],
        on_hang: Callable[[int, str], None],
        soft_timeout: float,
        interval: float,
        sidecar: Any = None,
    ) -> None:
        self._tid = thread_id
        self._state = state
        self._on_hang = on_hang
        self._soft = soft_timeout
        self._interval = interval
        self._sidecar = sidecar
        self._stop = threading.Event()
        self.lost: str | None = None
        self._position: tuple[int, int] | None = None
        self._progress = time.monotonic()
        self._round = -1
        self._flagged = -1
        self._recorders: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="trainguard-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for thread in self._recorders:
            thread.join(5.0)

    def _record(self, n: int, why: str) -> None:
        """Record a fault in a thread of its own: a store that does not answer must never stop
        the lines to the sidecar (it would take the silence for a hang that holds the GIL)."""
        self._recorders = [t for t in self._recorders if t.is_alive()]
        thread = threading.Thread(
            target=self._on_hang, args=(n, why), name="trainguard-fault", daemon=True
        )
        thread.start()
        self._recorders.append(thread)

    def _where(self) -> tuple[tuple[int, int] | None, str]:
        frame = sys._current_frames().get(self._tid)
        if frame is None:
            return None, "?"
        position = (id(frame.f_code) ^ id(frame), frame.f_lasti)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        return position, where

    def _sample(self, now: float) -> float:
        n, in_fn, call = self._state()
        if n != self._round or not in_fn:
            self._round = n if in_fn else self._round
            self._progress = now
            self._position = None
            return 0.0
        position, where = self._where()
        if position != self._position:
            self._position = position
            self._progress = now
        if call is not None and call.pings and call.last_ping > self._progress:
            self._progress = call.last_ping  # a ping is progress even where the frame stays
        stall = now - self._progress
        why = None
        if stall >= self._soft:
            why = f"no progress for {stall:.1f} s (soft_timeout={self._soft:g} s) at {where}"
        elif call is not None and call.pings and now - call.last_ping >= self._soft:
            why = (
                f"no call.ping() for {now - call.last_ping:.1f} s "
                f"(soft_timeout={self._soft:g} s) at {where}"
            )
            stall = now - call.last_ping
        if why is not None and self._flagged != n:
            self._flagged = n
            frame = sys._current_frames().get(self._tid)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            logger.error("hang detected in round %d: %s\n%s", n, why, stack)
            events.emit("hang", soft=True, reason=why, stack=stack[-2000:])
            self._record(n, f"hang: {why}")
        return stall

    def _run(self) -> None:
        while True:  # the first line at once: the sidecar's hard timeout counts from its start
            now = time.monotonic()
            try:
                stall = self._sample(now)
            except Exception:
                logger.exception("watchdog sample failed")
                stall = 0.0
            if self._sidecar is not None and self.lost is None:
                self._tell_sidecar(self._sidecar, stall)
            if self._stop.wait(self._interval):
                return

    def loss(self) -> str | None:
        """Why the sidecar is lost (:attr:`lost`), looked at now rather than at the next
        sample: a rank about to enter the next round must not run it unwatched."""
        sidecar = self._sidecar
        if self.lost is None and sidecar is not None and not sidecar.alive():
            return str(sidecar.loss())
        return self.lost

    def _tell_sidecar(self, sidecar: Any, stall: float) -> None:
        _, in_fn, _ = self._state()
        if sidecar.alive() and sidecar.send({"hb": 1, "in_fn": in_fn, "stall": round(stall, 3)}):
            return
        self.lost = sidecar.loss()
        logger.error("rank's %s; this rank leaves the job", self.lost)
        events.emit("sidecar_lost", helper_pid=sidecar.watcher_pid)
        self._record(self._state()[0], f"sidecar lost: {self.lost}")
