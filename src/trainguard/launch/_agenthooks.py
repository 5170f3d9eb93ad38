"""What the trainguard agent calls out to: its sidecar service and its node heartbeat.

The protocols of the two hooks of :class:`~trainguard.launch.agent.TrainguardAgent` (re-exported
by :mod:`trainguard.launch.agent`), and the agent's notices to the service about its workers;
each notice does nothing without a service, and one the service fails on is logged, never
raised into the agent's loop (``expect`` excepted).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trainguard.launch.options import LaunchOptions

logger = logging.getLogger(__name__)


class Service(Protocol):
    """The agent's sidecar service for its workers (see ``trainguard.restart.sidecar.agent_service``)."""

    address: str

    def start(self) -> None: ...

    def close(self) -> None: ...

    def expect(self, slot: int, pid: int, incarnation: int) -> None: ...

    def died(
        self, slot: int, pid: int, exit_code: int | None, *, returning: bool, timeout: float
    ) -> bool: ...

    def gone(self, slot: int, cause: str) -> None: ...


class Heartbeat(Protocol):
    """One node's heartbeat for one generation (see ``trainguard.launch.heartbeat``)."""

    def start(self) -> None: ...

    def close(self) -> None: ...


def expect(service: Service | None, slot: int, pid: int, incarnation: int) -> None:
    """A worker process of rank ``slot`` started (right after its start)."""
    if service is not None:
        service.expect(slot, pid, incarnation)


def died(
    service: Service | None, slot: int, pid: int, code: int, *, returning: bool, timeout: float
) -> None:
    """Rank ``slot``'s worker exited with ``code`` (``returning``: its slot is respawned)."""
    if service is None:
        return
    try:
        service.died(slot, pid, code, returning=returning, timeout=timeout)
    except Exception:
        logger.exception("the sidecar service could not record rank %d's death", slot)


def gone(service: Service | None, slot: int, cause: str) -> None:
    """Rank ``slot`` is counted out: its node was declared lost."""
    if service is None:
        return
    try:
        service.gone(slot, cause)
    except Exception:
        logger.exception("the sidecar service could not count rank %d out", slot)


def worker_env(
    service: Service | None, options: LaunchOptions, events_dir: str | None
) -> dict[str, str]:
    """The part of what the agent adds to every worker's environment that does not change
    with the generation: the preemption grace, the event log, the sidecar service."""
    env = {"TRAINGUARD_PREEMPTION_GRACE": repr(options.preemption_grace)}
    if events_dir:
        env["TRAINGUARD_EVENTS_DIR"] = events_dir
    if service is not None:
        env["TRAINGUARD_AGENT"] = service.address
    return env
