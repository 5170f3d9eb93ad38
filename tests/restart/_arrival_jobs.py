"""Rank functions for the node arrival tests; module level
for the ranks' processes. Each wraps :meth:`Session.arrive` of this rank to put a fault or a
delay at a chosen point of its arrival at a chosen barrier, then runs
:func:`tests.restart._faults.fault_job` (round 0 ends with ``victim``'s exception)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.restart import _faults

#: Wrapper timeouts: nothing here needs the short ones (a loaded machine kills a slow rank)
SLOW = {"soft_timeout": 10.0, "hard_timeout": 20.0, "barrier_timeout": 40, "store_timeout": 20}


def _gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie until its parent reaps it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wrap_arrive(hook: Any) -> None:
    """Call ``hook(session, n, phase)`` before (``"before"``) and after (``"after"``) this
    rank's arrival at each barrier."""
    from trainguard.restart._session import Session

    original = Session.arrive

    def arrive(self: Any, n: int, **kwargs: Any) -> Any:
        hook(self, n, "before")
        raw = original(self, n, **kwargs)
        hook(self, n, "after")
        return raw

    Session.arrive = arrive  # type: ignore[method-assign]


def death_job(victim: int, when: str, out_dir: str) -> dict[str, Any]:
    """``victim`` dies (SIGKILL) at round 1's barrier: ``"sent"``, right after it handed its
    record to its node watcher; ``"unsent"``, right before. The others come to that barrier
    0.3 s late, so that the node has not flushed the victim's record when it dies."""
    rank = int(os.environ["RANK"])

    def hook(session: Any, n: int, phase: str) -> None:
        if n != 1:
            return
        if rank != victim and phase == "before":
            time.sleep(0.3)
        elif rank == victim and phase == ("after" if when == "sent" else "before"):
            assert when != "sent" or session._sent is not None, "not arrived through the node"
            Path(out_dir, f"fault-{victim}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    _wrap_arrive(hook)
    return _faults.fault_job(10, victim, 4, "raise", out_dir, SLOW)


def watcher_death_job(late: int, out_dir: str) -> dict[str, Any]:
    """Round 0 ends with rank 0's exception. At round 1's barrier, rank ``late`` comes 2.5 s
    after the others: its node flushes the others' records at the bound (1 s); then ``late``
    kills the node watcher, waits for it to be gone and arrives. Round 1 holds at step 5."""
    rank = int(os.environ["RANK"])

    def hook(session: Any, n: int, phase: str) -> None:
        if n != 1 or rank != late or phase != "before":
            return
        time.sleep(2.5)
        pid = session.node.watcher_pid  # this job's (another job's may run on this host)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    _wrap_arrive(hook)
    # round 1 holds at step 5 until its watchdog takes the rank out: it cannot finish its steps
    # first on a loaded machine
    return _faults.fault_job(10, 0, 4, "raise", out_dir, SLOW, hold_round=1)
