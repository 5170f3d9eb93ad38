"""A node's own judgement that it is cut off from the job: the fence.

The node that hosts nothing cannot tell a partition from the others' deaths; what it can tell is
that *it* has not reached the coordination store for a while. The others declare a node lost
once its heartbeat value has not moved for ``timeout`` seconds by their clocks, counted from the
moment they saw the value, which is after the node started the beat that wrote it. So a node
that fences itself ``timeout - interval`` seconds after the start of its last beat that reached
the store (by its own clock) has stopped before any other node may count it out:

- :class:`Fence` watches the heartbeat's ``last_ok`` on a thread of its own (``tg-node-fence``;
  the beat thread and the agent's thread may both sit in a store call that will time out) and
  calls ``on_fence(silent)`` once, when the silence reaches ``after``;
- the agent then stops its workers (SIGKILL: their collectives end, they start no round and
  commit nothing), respawns nothing, makes no store call of its own, and waits: for its
  heartbeat to reach the store again (:meth:`Fence.lift`, the node was not declared lost: its
  workers' deaths go the usual way), for its eviction (it was declared lost: it rejoins through
  a vacancy or leaves, ``--tg-on-evicted``), or for ``give_up`` seconds (it leaves the job with
  :class:`~trainguard.errors.NodeLeftError`).

Nothing a fenced node does touches the store, so it can change neither a committed checkpoint
nor the running job's rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Fence"]

logger = logging.getLogger(__name__)


class Fence:
    """Fences a node whose heartbeat has not reached the store for ``after`` seconds.

    Args:
        last_ok: when (by ``clock``) the node's last beat that reached the store started;
            ``None`` before the first one.
        after: the silence that fences, in seconds (the agent gives ``timeout - interval``).
        on_fence: called once per fence, on the fence thread, with the silence in seconds.
        clock: monotonic clock in seconds (tests give a fake one and call :meth:`check`).

    Protocol: the agent makes one per generation, right after the node's heartbeat started,
    :meth:`start`s it and :meth:`close`s it with the heartbeat; :meth:`lift` when the heartbeat
    reached the store again after the fence.
    """

    def __init__(
        self,
        last_ok: Callable[[], float | None],
        *,
        after: float,
        on_fence: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not after > 0:
            raise ValueError(f"after={after!r} must be > 0 seconds")
        self._last_ok, self.after, self._on_fence, self._clock = last_ok, after, on_fence, clock
        self._started = clock()
        #: when (by ``clock``) this node fenced itself; ``None`` while it is not fenced.
        self.fenced_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """One judgement: fence (once) when the heartbeat has been silent for ``after``;
        returns whether the node is fenced."""
        if self.fenced_at is not None:
            return True
        last = self._last_ok()
        silent = self._clock() - (self._started if last is None else last)
        if silent < self.after:
            return False
        self.fenced_at = self._clock()
        logger.error(
            "this node has not reached the coordination store for %.1f s: it fences itself "
            "(its workers are stopped; the other nodes may count it out)",
            silent,
        )
        try:
            self._on_fence(silent)
        except Exception:
            logger.exception("fencing this node failed")
        return True

    def lift(self) -> None:
        """The heartbeat reached the store again and the node was not declared lost."""
        if self.fenced_at is not None:
            logger.warning(
                "the coordination store answers again after %.1f s fenced; the node goes on",
                self._clock() - self.fenced_at,
            )
        self.fenced_at = None
        self._started = self._clock()

    def start(self) -> None:
        """Judge every ``after / 10`` seconds (at most 0.25 s) on ``tg-node-fence``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tg-node-fence", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        period = min(0.25, self.after / 10)
        while not self._stop.wait(period):
            self.check()

    def close(self) -> None:
        """Stop judging (the thread has ended when this returns). Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
