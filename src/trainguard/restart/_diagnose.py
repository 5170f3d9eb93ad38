"""What this rank reports about how one round of a wrapped call went on it.

Functions of :class:`~trainguard.restart._run.WrappedCall`'s round that need little of it: a
user's hook that raised (the rank then leaves), a round outcome that contradicts what the
function did here, a restart interrupt the function swallowed, and the main thread's stack when
it stays blocked after the abort, and the error of a rank that lost its sidecar. Each logs and
emits its event (or builds the error); none changes the round.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any

from trainguard import events
from trainguard.errors import SidecarLostError
from trainguard.restart._book import RoundBook
from trainguard.restart.state import RestartInterrupt, RoundOutcome, RoundState, describe

logger = logging.getLogger(__name__)


def run_hook(name: str, hook: Any, state: RoundState) -> BaseException | None:
    """Run the user's ``hook`` (``name``: its option); what it raised, None if it returned."""
    if hook is None:
        return None
    try:
        hook(state)
    except Exception as exc:
        logger.error("rank %d: %s raised %s; leaving the job", state.initial_rank, name, exc)
        events.emit(f"{name}_failed", error=describe(exc))
        return exc
    return None


def check_raised(rank: int, n: int, exc: Exception | None, outcome: RoundOutcome) -> None:
    """The function raised ``exc`` in round ``n`` on this rank, yet the round's outcome says it
    completed: only a write by someone else says that (a round completes when every
    active rank returned, and this one did not). The rank never returns normally then:
    it re-raises its own exception (the job cannot restart a round the others left)."""
    if exc is None or outcome.why != "complete":
        return
    logger.error(
        "rank %d: the function raised %s in round %d but the store says the round "
        "completed; something other than this job wrote the round's outcome (give each job "
        "its own store and set TRAINGUARD_JOB_SECRET): raising the function's exception",
        rank,
        describe(exc),
        n,
    )
    events.emit("outcome_contradicted", error=describe(exc))
    raise exc


def check_swallowed(rank: int, returned: bool) -> None:
    """Warn when the function returned after swallowing the restart interrupt raised in it."""
    # dropped here: its traceback holds the function's frames, and through them the
    # round's process group (a collective's ``group`` local) and whatever else they held
    interrupt, RestartInterrupt.last = RestartInterrupt.last, None
    if interrupt is None or not returned:
        return
    where = interrupt.swallowed_at()
    logger.warning(
        "rank %d: the restart interrupt raised at %s was swallowed at %s; let "
        "BaseException propagate (catch Exception instead)",
        rank,
        interrupt.raised_at,
        where,
    )
    events.emit("interrupt_swallowed", raised_at=interrupt.raised_at, swallowed_at=where)


def report_stuck(rank: int, reason: str, thread_id: int | None) -> None:
    """Log and emit where the main thread (``thread_id``) is blocked after the abort."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
    logger.error("rank %d: %s; main thread at:\n%s", rank, reason, stack)
    events.emit("abort_stuck", stack=stack[-2000:])


def sidecar_lost(rank: int, lost: str) -> SidecarLostError:
    """The error of a rank that leaves the job because it lost its sidecar (``lost``: how)."""
    return SidecarLostError(
        f"rank {rank}: {lost}; it left the job rather than run without "
        "protection (see the node watcher's sidecar-node-<host>.log in the events directory, "
        "else sidecar-node-<job>-<call>.log in this user's private directory, or the launcher's "
        "sidecar-service-<pid>.log under `trainguard launch`)",
        causes={rank: lost},
    )


def record_hang(book: RoundBook, rank: int, n: int, why: str) -> None:
    """Watchdog thread: record a hang (or the sidecar's loss) seen on ``rank`` as round
    ``n``'s fault, through the call's ``book``;
    a store that fails is logged (the round's other ways of ending still work)."""
    kind = "Hang" if why.startswith("hang") else "SidecarLost"
    try:
        book.propose(n, RoundOutcome.fault(rank, why, kind))
    except Exception as exc:
        logger.error("could not record the fault %r: %s", why, exc)
