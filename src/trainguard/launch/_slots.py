"""Per-slot bookkeeping of the agent: incarnations, respawn budget, back-off, crash loops.

A *slot* is one local worker position (one ``LOCAL_RANK``, one global ``RANK``) in one
generation. It holds one process at a time; when that process exits non-zero the table decides
whether to respawn the slot (and when) or to escalate to a whole-job restart. No processes here:
the agent reports starts and exits, the table answers, against an injectable clock.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping

from trainguard.restart.preempt import EXIT_PREEMPTED

__all__ = [
    "CRASH_LOOP",
    "CRASH_UPTIME",
    "Escalate",
    "Respawn",
    "SlotPolicy",
    "SlotState",
    "SlotTable",
]

#: consecutive early deaths of one slot that make a crash loop.
CRASH_LOOP = 3
#: a process that dies sooner than this after its start died early (seconds).
CRASH_UPTIME = 10.0


class SlotState(enum.Enum):
    RUNNING = "running"  # a process is running
    WAITING = "waiting"  # its process died; a respawn is due at ``respawn_at``
    DONE = "done"  # its process exited 0


@dataclasses.dataclass(frozen=True)
class SlotPolicy:
    """How slots are respawned.

    ``respawns``: respawns per slot per generation; the next death escalates. ``backoff``: delay
    before the first respawn; the k-th respawn (k >= 2) waits ``base * 2**(k-1)`` where ``base``
    is ``backoff``, or 0.25 s when ``backoff`` is 0 (so 0, 0.5, 1, 2 s...). ``crash_loop``
    consecutive deaths each within ``crash_uptime`` seconds of the start escalate even with
    budget left.
    """

    respawns: int = 3
    backoff: float = 0.0
    crash_loop: int = CRASH_LOOP
    crash_uptime: float = CRASH_UPTIME

    def delay(self, k: int) -> float:
        """Seconds to wait before the ``k``-th respawn (``k`` >= 1) of a slot."""
        if k <= 1:
            return self.backoff
        base = self.backoff if self.backoff > 0 else 0.25
        return float(base * 2 ** (k - 1))


@dataclasses.dataclass(frozen=True)
class Respawn:
    """Respawn ``local_rank`` as ``incarnation`` at monotonic time ``at``."""

    local_rank: int
    incarnation: int
    at: float
    budget_left: int


@dataclasses.dataclass(frozen=True)
class Escalate:
    """Restart the whole job: ``reason`` says why."""

    reason: str


@dataclasses.dataclass
class _Slot:
    local_rank: int
    rank: int
    state: SlotState = SlotState.RUNNING
    incarnation: int = 0
    pid: int | None = None
    started: float = 0.0
    respawns: int = 0
    early_deaths: int = 0
    respawn_at: float | None = None
    exit_code: int | None = None


class SlotTable:
    """The slots of one agent in one generation.

    Protocol (all from the agent's monitor thread): :meth:`started` after each process start,
    :meth:`exited` when the agent saw it exit (returns ``None`` for exit code 0, a
    :class:`Respawn` or an :class:`Escalate`), :meth:`due` on each tick for respawns whose time
    has come, then :meth:`started` again with the new pid. ``incarnation``: of every slot's
    first process (a replacement node's workers are newcomers: >= 1).
    """

    def __init__(
        self,
        ranks: Mapping[int, int],
        policy: SlotPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        incarnation: int = 0,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self._slots = {
            lr: _Slot(lr, rank, incarnation=incarnation) for lr, rank in sorted(ranks.items())
        }

    def __contains__(self, local_rank: int) -> bool:
        return local_rank in self._slots

    def started(self, local_rank: int, pid: int) -> int:
        """A process ``pid`` now runs in the slot; returns its incarnation."""
        slot = self._slots[local_rank]
        if slot.state is SlotState.WAITING:
            slot.incarnation += 1
        slot.state = SlotState.RUNNING
        slot.pid = pid
        slot.started = self.clock()
        slot.respawn_at = None
        slot.exit_code = None
        return slot.incarnation

    def exited(self, local_rank: int, exit_code: int) -> Respawn | Escalate | None:
        """The slot's process exited with ``exit_code`` (negative: killed by that signal)."""
        slot = self._slots[local_rank]
        if slot.state is not SlotState.RUNNING:
            raise ValueError(f"slot {local_rank} has no running process ({slot.state.value})")
        slot.exit_code = exit_code
        if exit_code in (0, EXIT_PREEMPTED):  # preempted: its state is saved, not a death
            slot.state = SlotState.DONE
            return None
        now = self.clock()
        uptime = now - slot.started
        slot.early_deaths = slot.early_deaths + 1 if uptime < self.policy.crash_uptime else 0
        slot.state = SlotState.WAITING
        if slot.early_deaths >= self.policy.crash_loop:
            return Escalate(
                f"crash loop: rank {slot.rank} died {slot.early_deaths} times in a row, each "
                f"within {self.policy.crash_uptime:g} s of its start (last exit code {exit_code})"
            )
        if slot.respawns >= self.policy.respawns:
            return Escalate(
                f"rank {slot.rank} died (exit code {exit_code}) with its respawn budget of "
                f"{self.policy.respawns} used up"
            )
        slot.respawns += 1
        slot.respawn_at = now + self.policy.delay(slot.respawns)
        return Respawn(
            local_rank,
            slot.incarnation + 1,
            slot.respawn_at,
            self.policy.respawns - slot.respawns,
        )

    def hold(self, local_rank: int) -> None:
        """A slot whose process died is not respawned (its host is quarantined): it is done
        for this generation."""
        slot = self._slots[local_rank]
        if slot.state is SlotState.WAITING:
            slot.state = SlotState.DONE
            slot.respawn_at = None

    def due(self) -> list[int]:
        """Local ranks whose respawn time has come, in order."""
        now = self.clock()
        return [
            s.local_rank
            for s in self._slots.values()
            if s.state is SlotState.WAITING and s.respawn_at is not None and s.respawn_at <= now
        ]

    def running(self) -> list[int]:
        """Local ranks with a running process, in order."""
        return [s.local_rank for s in self._slots.values() if s.state is SlotState.RUNNING]

    def state(self, local_rank: int) -> SlotState:
        return self._slots[local_rank].state

    def incarnation(self, local_rank: int) -> int:
        return self._slots[local_rank].incarnation

    def rank(self, local_rank: int) -> int:
        return self._slots[local_rank].rank

    def pid(self, local_rank: int) -> int | None:
        return self._slots[local_rank].pid

    def budget_left(self, local_rank: int) -> int:
        return self.policy.respawns - self._slots[local_rank].respawns

    @property
    def all_done(self) -> bool:
        """Every slot's process exited 0."""
        return all(s.state is SlotState.DONE for s in self._slots.values())
