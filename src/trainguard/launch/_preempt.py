"""The agent's side of a preemption: a SIGTERM to the agent is forwarded to its workers, which
save their state at an agreed step (:mod:`trainguard.restart.preempt`), and the agent waits for
them within the grace budget instead of killing them.

torch's own shutdown sends the signal and kills what still runs after ``shutdown_timeout``;
:func:`save` does the signalling and the wait first, with the budget (plus
:data:`PREEMPT_MARGIN`), while the agent's heartbeat and sidecar service go on (a node that
went silent would be declared lost by the others and their save aborted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

from trainguard.launch import _compat
from trainguard.restart.preempt import EXIT_PREEMPTED

logger = logging.getLogger(__name__)

#: seconds the agent waits for its workers past the grace budget before they are killed (each
#: worker's own budget ends it at the budget)
PREEMPT_MARGIN = 5.0


def save(agent: Any, grace: float) -> bool:
    """Forward SIGTERM to every running worker's process group and wait for them, at most
    ``grace`` + :data:`PREEMPT_MARGIN` seconds. True when every worker ended with status 0 or
    75 and at least one with 75 (the job was preempted and saved). ``agent`` is the
    :class:`~trainguard.launch.agent.TrainguardAgent` (typed loosely: this module must not import
    the agent's module, which calls it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the wait
    context = _compat.pcontext(agent)
    handlers = list(context.subprocess_handlers.values())
    wait = grace + PREEMPT_MARGIN
    logger.warning(
        "SIGTERM: preemption; the workers save their state, waiting up to %g s for them", wait
    )
    agent.events.emit("launch_preempt", grace=grace)
    for h in handlers:
        if h.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(h.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    for h in handlers:
        with contextlib.suppress(Exception):
            h.proc.wait(max(0.0, deadline - time.monotonic()))
    codes = [h.proc.returncode for h in handlers]
    if all(c in (0, EXIT_PREEMPTED) for c in codes):
        return EXIT_PREEMPTED in codes
    logger.warning(
        "SIGTERM: the workers ended with statuses %s (%d: saved after a preemption; None: "
        "still running, killed now)",
        codes,
        EXIT_PREEMPTED,
    )
    return False
