"""The agent's side of an escalation: a whole-job restart, or the end of a job that cannot start.

The key and its protocol are :mod:`trainguard.coord.escalation`. The agent (its main thread):

1. reads the key on each monitor tick and at each worker's death (:func:`requested`; the worker
   that asked may have exited before the tick's read), and ends its run's loop when it is set;
2. asks itself (:func:`escalate` with ``announce``) when a slot's budget is used up or it
   crash-loops;
3. reports FAILED to torch's loop: for a restart, torch's ``--max-restarts`` decides whether a
   new generation starts; for a request to end the job (an error raised before the first
   round, :func:`~trainguard.coord.escalation.cannot_start`) no restart is left, the
   agent's :attr:`~trainguard.launch.agent.TrainguardAgent.cannot_start` says why and
   ``trainguard launch`` prints it once.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainguard.coord.escalation import cannot_start
from trainguard.launch import _compat

__all__ = ["escalate", "requested"]

logger = logging.getLogger(__name__)


def requested(agent: Any) -> str | None:
    """The reason in the escalation key of the agent's generation, or ``None``. A store that
    does not answer is the fence's business (``agent.partition``); a signal that lands in the
    call is not a store failure and goes on up. ``agent`` is the
    :class:`~trainguard.launch.agent.TrainguardAgent` (typed loosely: that module imports this
    one)."""
    assert agent.generation is not None
    try:
        reason: str | None = agent.coord.escalation(agent.run_id, agent.generation)
        return reason
    except SignalException:
        raise
    except Exception as exc:  # cut off, or the store is gone: the fence decides
        agent.partition.store_failed(exc)
        return None


def escalate(
    agent: Any, reason: str, failures: dict[int, ProcessFailure], *, announce: bool = True
) -> RunResult:
    """Ask every agent for a whole-job restart (``announce``: set the escalation key) and
    report FAILED to torch's loop; for a request to end the job, end it (no restart left)."""
    assert agent.generation is not None
    error = cannot_start(reason)
    if error is not None:  # a worker's error before its first round: the job ends
        agent.cannot_start = error
        _compat.no_more_restarts(agent)
        agent.events.emit("launch_cannot_start", reason=error, generation=agent.generation)
        logger.info("the job cannot start (%s): no respawn, no whole-job restart", error)
        return RunResult(state=WorkerState.FAILED, failures=failures)
    agent.last_escalation = reason
    if announce:
        try:
            agent.coord.escalate(agent.run_id, agent.generation, reason)
        except Exception as exc:
            logger.warning("could not set the escalation key (%s)", exc)
    agent.events.emit("launch_escalated", reason=reason, generation=agent.generation)
    logger.error("whole-job restart of generation %d: %s", agent.generation, reason)
    return RunResult(state=WorkerState.FAILED, failures=failures)
