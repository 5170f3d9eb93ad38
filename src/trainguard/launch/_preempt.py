"""The agent's side of a preemption: a SIGTERM to the agent is forwarded to its workers, which
save their state at an agreed step (:mod:`trainguard.restart.preempt`), and the agent waits for
them within the grace budget instead of killing them.

torch's own shutdown sends the signal and kills what still runs after ``shutdown_timeout``.
Here, in this order:

1. :func:`forward` (the agent's signal thread, :mod:`trainguard.launch._signals`) sends the
   SIGTERM to every running worker's process group the moment it reaches the agent, even while
   the agent's main thread waits in a store call.
2. :func:`save` (the agent's shutdown for that SIGTERM) signals the workers ``forward`` missed
   and waits for them, with the budget (plus :data:`PREEMPT_MARGIN`), while the agent's
   heartbeat and sidecar service go on (a node that went silent would be declared lost by the
   others and their save aborted).
3. :func:`arrive` once they saved: this node counts as finished in the exit barrier, so the
   other nodes, whose workers stop at the same step, exit as soon as theirs did (they no longer
   wait out their exit-barrier timeout for a node that never arrives); the agent that hosts
   the coordination store waits for them there (its store serves their last steps), at most
   until the budget ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

from trainguard.launch import _compat, _nodes
from trainguard.restart.preempt import EXIT_PREEMPTED

logger = logging.getLogger(__name__)

#: seconds the agent waits for its workers past the grace budget before they are killed (each
#: worker's own budget ends it at the budget)
PREEMPT_MARGIN = 5.0


def forward(agent: Any, sent: set[int]) -> None:
    """SIGTERM to the process group of each of the agent's workers that has not exited; adds
    the pids signalled to ``sent``. Any thread: it only reads the process table (a worker that
    exited but was not reaped yet still owns its group's id). ``agent`` is the
    :class:`~trainguard.launch.agent.TrainguardAgent` (typed loosely: this module must not
    import the agent's module, which calls it)."""
    context = getattr(agent, "_pcontext", None)
    handlers = dict(getattr(context, "subprocess_handlers", None) or {})
    for h in handlers.values():
        pid = h.proc.pid
        if h.proc.returncode is None and pid not in sent:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            sent.add(pid)


def save(agent: Any, grace: float, sent: set[int]) -> bool:
    """Forward SIGTERM to every running worker's process group not in ``sent`` (those
    :func:`forward` signalled already) and wait for them, at most ``grace`` +
    :data:`PREEMPT_MARGIN` seconds. True when every worker ended with status 0 or 75 and at
    least one with 75 (the job was preempted and saved). Workers that had all ended before
    the signal (it came in the exit barrier) are not a preemption of this node: no line, no
    event, and True only if one of them ended with 75."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the wait
    context = _compat.pcontext(agent)
    handlers = list(context.subprocess_handlers.values())
    wait = grace + PREEMPT_MARGIN
    if sent or any(h.proc.poll() is None for h in handlers):  # else they had all ended
        logger.warning(
            "SIGTERM: preemption; the workers save their state, waiting up to %g s for them",
            wait,
        )
        agent.events.emit("launch_preempt", grace=grace)
        forward(agent, sent)
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


def arrive(agent: Any, deadline: float) -> None:
    """After :func:`save` returned True: count this node as finished in the exit barrier of
    its generation; the agent that hosts the coordination store waits there for the other
    nodes until ``deadline`` (``time.monotonic()``). Never raises (the store may be gone)."""
    place, coord = agent.nodes.place, agent.coord
    if place is None or coord.client is None:
        return
    try:
        if coord.server is None:
            _nodes.mark_done(coord.client, place.run_id, place.generation, place.node)
            return
        left = max(0.0, deadline - time.monotonic())
        missing = _nodes.exit_barrier(coord.client, place, timeout=left, poll=0.05)
    except Exception as exc:
        logger.info("preemption: the exit barrier ended by the store (%s)", exc)
        return
    if missing:
        logger.warning("preemption: nodes %s did not finish their save in time", missing)
