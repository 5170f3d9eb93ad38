"""What an agent does when its node is cut off from the job, and when it comes back.

A partition is not a death, and the side that reaches the coordination store is the job: there is
no second opinion. Per node (one :class:`Partition` per agent, driven from the agent's monitor
tick, plus the fence thread of :mod:`trainguard.launch._fence`):

1. **Cut off.** The node's heartbeat has not reached the store for ``heartbeat_timeout -
   heartbeat_interval`` seconds by its own clock: the node fences itself before any other node may
   declare it lost. Its workers are SIGKILLed (their collectives end; they start no round and
   commit no checkpoint), the admission gate stops reading the store, and the agent respawns
   nothing and writes nothing to the store while fenced.
2. **Back, not declared lost** (the cut was shorter than the others' timeout): the fence lifts,
   the agent connects to the store afresh and its workers' deaths go the usual way (death
   notices, respawns within ``--tg-respawns``).
3. **Back, declared lost** (the others counted its ranks out and went on): the node never restarts
   or ends the rest of the job. With ``--tg-on-evicted rejoin`` (default) it claims a free place
   of the running job (the vacancy its declarer offered, see :mod:`trainguard.launch._gate`) and
   starts its workers as newcomers, admitted at a round boundary; with ``exit``, or when no place
   is free, it leaves: the launcher exits with status 3 (:class:`~trainguard.errors.NodeLeftError`).
4. **Never back**: after ``--tg-fence-timeout`` seconds fenced the node leaves the same way.
5. **The store is gone**, not out of reach: its host answers but refuses connections (the
   agent that hosted it ended). No partition heals that: the node stops its workers and leaves
   at once.

A whole-job restart is asked for only by a node that is part of the job: a store call that fails
in the agent's tick no longer asks for one (it used to: a partitioned node then ended the job).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from trainguard import events
from trainguard.coord.store import parse_addr, probe
from trainguard.launch._coordstore import CoordStore
from trainguard.launch._fence import Fence
from trainguard.launch._nodes import AgentNodes
from trainguard.launch.options import LaunchOptions

__all__ = ["Partition", "Verdict"]

logger = logging.getLogger(__name__)


class Verdict(enum.Enum):
    """What the agent's tick does (:meth:`Partition.tick`)."""

    GO_ON = "go on"  # part of the job: watch the workers as usual
    FENCED = "fenced"  # cut off: touch neither the workers' slots nor the store
    EVICTED = "evicted"  # declared lost: rejoin or leave
    LEAVE = "leave"  # fenced for too long: leave the job


class Partition:
    """One agent's dealings with partitions (see the module docstring).

    Args:
        options: the agent's options (heartbeat interval and timeout, fence timeout).
        nodes: the agent's node watch (eviction, "reached the store again").
        coord: the agent's coordination store handle (reconnected after a failure).
        log: the agent's event log.
        kill_workers: SIGKILLs the running workers (their process groups); returns their pids.
        clock: monotonic clock in seconds.

    Protocol (the agent's thread unless said otherwise): :meth:`start` with each generation's
    heartbeat, :meth:`close` with it; :meth:`tick` first thing on every monitor tick;
    :meth:`store_failed` when a store call of the tick failed. The fence calls back on its own
    thread.
    """

    def __init__(
        self,
        *,
        options: LaunchOptions,
        nodes: AgentNodes,
        coord: CoordStore,
        log: events.EventLog,
        kill_workers: Callable[[], list[int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options, self.nodes, self.coord, self.log = options, nodes, coord, log
        self._kill_workers, self._clock = kill_workers, clock
        self.fence: Fence | None = None
        self._broken = False  # a store call of the agent's own client failed
        #: why this node left the job (``None``: it did not).
        self.left: str | None = None

    @property
    def fenced(self) -> bool:
        return self.fence is not None and self.fence.fenced_at is not None

    def start(self, heartbeat: Any) -> None:
        """Watch ``heartbeat`` (its ``last_ok``) from now on; a fence of an older heartbeat
        is closed."""
        self.close()
        if not hasattr(heartbeat, "last_ok"):
            return  # a heartbeat of tests' making: no fence
        after = self.options.heartbeat_timeout - self.options.heartbeat_interval
        self.fence = Fence(lambda: heartbeat.last_ok, after=after, on_fence=self._fenced)
        self.fence.start()

    def close(self) -> None:
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.close()

    def _fenced(self, silent: float) -> None:
        """The fence thread: stop everything this node does for the job."""
        if self.nodes.gate is not None:
            self.nodes.gate.pause()
        killed = self._kill_workers()
        self.log.emit("launch_fenced", silent=silent, workers=killed)

    def store_failed(self, exc: BaseException) -> None:
        """A store call of the agent's tick failed: reconnect before the next one. (If the node
        is cut off, the fence follows; no whole-job restart is asked for.)"""
        if not self._broken:
            logger.warning("the coordination store did not answer (%s)", exc)
        self._broken = True

    def tick(self) -> Verdict:
        """The agent's monitor tick, first thing (see :class:`Verdict`)."""
        if self.nodes.eviction is not None:
            return Verdict.EVICTED
        fence = self.fence
        if (self._broken or self.fenced) and self._refused():
            self._kill_workers()
            self.left = (
                f"the coordination store at {self.coord.addr} is gone (its host refuses "
                "connections: the agent or store process that hosted it ended); this node "
                "stopped its workers and leaves the job"
            )
            return Verdict.LEAVE
        if fence is None or fence.fenced_at is None:
            self.nodes.reached_again = False
            if self._broken:
                self._reconnect()
            return Verdict.GO_ON
        if self.nodes.reached_again:  # back before the others counted this node out
            self.nodes.reached_again = False
            self._broken = True
            if self._reconnect():
                fence.lift()
                self.log.emit("launch_unfenced", seconds=self._clock() - fence.fenced_at)
                return Verdict.GO_ON
        self._kill_workers()  # any that started as the fence came down
        fenced_for = self._clock() - fence.fenced_at
        if fenced_for >= self.options.fence_timeout:
            self.left = (
                f"this node could not reach the coordination store for {fenced_for:.0f} s "
                f"(--tg-fence-timeout {self.options.fence_timeout:g}); it stopped its workers "
                "and leaves the job"
            )
            return Verdict.LEAVE
        return Verdict.FENCED

    def _refused(self) -> bool:
        """Whether the store's host answers and refuses connections (a partition drops them)."""
        if self.coord.server is not None or self.coord.addr is None:
            return False
        return probe(*(self.coord.external or parse_addr(self.coord.addr))) == "refused"

    def _reconnect(self) -> bool:
        place = self.nodes.place
        try:
            self.coord.reconnect()
        except Exception as exc:
            logger.warning("cannot reconnect to the coordination store yet (%s)", exc)
            return False
        self._broken = False
        if self.nodes.gate is not None and place is not None:
            self.nodes.gate.follow(self.coord.client, place.generation)
        return True
