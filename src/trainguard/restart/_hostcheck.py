"""A rank's side of attribution and quarantine (see :mod:`.quarantine`), for :mod:`._run`.

Each round, on entering it, a rank reads the round's ``health`` (:mod:`._health`): the first
rank of the round (its active rank 0; the first spare in a round that ends the job) emits the attribution of the fault that ended the round before (``fault_attributed``)
and the hosts taken out or let back, and rewrites the quarantine file; a rank whose host is
out runs the probes before its next barrier and puts the result in its record. After the
round, the cause of the exception the rank raised, first or not, goes in its next record.
"""

from __future__ import annotations

import logging
from typing import TypedDict

from trainguard import events
from trainguard.errors import HostQuarantinedError, RetryLimitError
from trainguard.restart._attribution import cause_of, is_collective
from trainguard.restart._health import QUARANTINED, Health
from trainguard.restart._records import RoundLayout
from trainguard.restart.quarantine import Quarantine
from trainguard.restart.state import RoundState, describe

__all__ = ["HostCheck", "consequence", "own_error", "raised_cause"]

logger = logging.getLogger(__name__)


class RecordFields(TypedDict):
    """What :class:`HostCheck` adds to a rank's barrier record."""

    raised: str | None
    probe: str | None


def raised_cause(exc: BaseException | None) -> str | None:
    """The cause (kind and place) of the exception this rank raised in a round, or None."""
    return None if exc is None else cause_of(type(exc).__qualname__, describe(exc))


def consequence(exc: BaseException) -> bool:
    """Whether ``exc``, raised after this rank's round was aborted, is the abort's consequence
    (a collective that failed) rather than an error of this rank's own that lost the race to
    the store (kept for the attribution, :func:`._health.judge_round`)."""
    return is_collective(raised_cause(exc) or "")


def own_error(interrupt: BaseException) -> Exception | None:
    """The exception this rank was already raising when the abort's interrupt replaced it
    (its ``__context__``: the abort came while the function unwound, e.g. in a ``finally``
    that destroyed the process group), unless that too was a consequence; else None."""
    inner = interrupt.__context__
    if not isinstance(inner, Exception) or consequence(inner):
        return None
    return inner


def end_error(end: str) -> type[RetryLimitError]:
    """The error the ranks raise for a round published with ``end``."""
    return HostQuarantinedError if QUARANTINED in end else RetryLimitError


class HostCheck:
    """One rank's view: its host, whether it is out, and the quarantine (None: only the
    attribution events)."""

    def __init__(self, quarantine: Quarantine | None, host: str) -> None:
        self.quarantine = quarantine
        self.host = host
        self.out = False
        self.raised: str | None = None  # the cause of what this rank raised in the last round

    def record(self, state: RoundState) -> RecordFields:
        """The fields of this rank's next barrier record: ``raised`` and ``probe``."""
        return {"raised": self.raised, "probe": self.probe(state)}

    def enter(self, ready: RoundLayout, state: RoundState) -> None:
        """Round ``ready`` was published and this rank entered it (``state``)."""
        health = Health.decode(ready.health)
        self.out = self.host in health.out
        if self.quarantine is not None:
            why = str(health.out.get(self.host, {}).get("why", ""))
            try:
                self.quarantine.tell_node(self.host, self.out, why)
            except OSError as exc:
                logger.error("could not tell the launcher whether this host is out: %s", exc)
        lead = ready.active or ready.spare  # its first rank reports (spares: a job that ends)
        if not lead or lead[0] != state.initial_rank:
            return
        blame = health.blame
        if blame is not None:
            events.emit(
                "fault_attributed",
                fault_host=blame.host,
                fault_rank=blame.rank,
                fault_kind=blame.kind,
                cause=blame.cause,
                counted=blame.counted,
            )
        for host in health.new:
            why = str(health.out.get(host, {}).get("why", ""))
            logger.warning("host %s quarantined: %s", host, why)
            events.emit("host_quarantined", quarantined_host=host, why=why)
        for host in health.back:
            logger.warning("host %s passed its probes: back as a spare", host)
            events.emit("host_readmitted", quarantined_host=host)
        for host in health.freed:
            why = "the causes of its faults were seen on other hosts since: a software bug"
            logger.warning("host %s let go: %s", host, why)
            events.emit("host_released", quarantined_host=host, why=why)
        if self.quarantine is not None and ready.health is not None:
            try:
                self.quarantine.write(sorted(health.out))
            except OSError as exc:
                logger.error("could not write the quarantine file: %s", exc)

    def probe(self, state: RoundState) -> str | None:
        """Before the next barrier: the probes' result when this rank's host is out."""
        if not self.out or self.quarantine is None:
            return None
        result = self.quarantine.probe(state)
        events.emit("host_probe", result=result, passed=result == "ok")
        if result != "ok":
            logger.warning("host %s failed a health probe: %s", self.host, result)
        return result
