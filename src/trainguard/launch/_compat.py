"""The one module that touches private parts of ``torch.distributed.elastic``.

The agent replaces one worker process of torch's ``SubprocessContext`` at a time, which torch has
no public interface for. Everything it needs from torch's internals is read or written here, so
that a torch release that moves one of them breaks this module (and its contract test,
``tests/launch/test_compat.py``) instead of failing silently mid-job:

- ``SubprocessContext``: ``subprocess_handlers`` (local rank -> ``SubprocessHandler``),
  ``entrypoint``, ``args``, ``envs``, ``stdouts``, ``stderrs``, ``error_files``, ``_numa_options``;
- ``SubprocessHandler``: ``proc`` (its ``Popen``, leader of its own session), ``_stdout``,
  ``_stderr`` (the log files it opened), ``local_rank_id``; a warm worker's process is put in
  one built without its ``__init__`` (:func:`adopt`);
- ``LocalElasticAgent``: ``_pcontext``, ``_remaining_restarts`` (the whole-job restarts left;
  set to 0 when this node leaves the job), ``_uninterruptible_state_timeout`` and
  ``_check_uninterruptible_state_timeout`` (torch's D-state watchdog, absent from older releases; probed),
  ``_in_exit_barrier`` (the health check's "finished, waiting for the others" flag; set while
  the agent's own exit barrier runs);
- ``DynamicRendezvousHandler._stop_heartbeats`` (its keep-alive timer; probed): stopped when
  the rendezvous store is gone, until the next rendezvous round starts it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    SubprocessHandler,
    get_subprocess_handler,
)

from trainguard.errors import ConfigError

__all__ = [
    "CONTEXT_ATTRIBUTES",
    "HANDLER_ATTRIBUTES",
    "WorkerLaunch",
    "adopt",
    "check_uninterruptible",
    "handler",
    "in_exit_barrier",
    "launch_of",
    "missing",
    "no_more_restarts",
    "pcontext",
    "release",
    "replace",
    "stop_keepalive",
]

#: attributes of a started ``SubprocessContext`` the agent relies on.
CONTEXT_ATTRIBUTES = (
    "subprocess_handlers",
    "entrypoint",
    "args",
    "envs",
    "stdouts",
    "stderrs",
    "error_files",
    "_numa_options",
)
#: attributes of a ``SubprocessHandler`` the agent relies on.
HANDLER_ATTRIBUTES = ("proc", "_stdout", "_stderr", "local_rank_id")
#: attributes of ``LocalElasticAgent`` the agent relies on (the D-state ones are optional).
AGENT_ATTRIBUTES = ("_pcontext", "_remaining_restarts")
AGENT_OPTIONAL = (
    "_uninterruptible_state_timeout",
    "_check_uninterruptible_state_timeout",
    "_in_exit_barrier",
)


def missing(context: object, handle: object, agent: object) -> list[str]:
    """Names of the attributes above that ``context``, ``handle`` or ``agent`` lacks."""
    gone = [f"SubprocessContext.{a}" for a in CONTEXT_ATTRIBUTES if not hasattr(context, a)]
    gone += [f"SubprocessHandler.{a}" for a in HANDLER_ATTRIBUTES if not hasattr(handle, a)]
    gone += [f"LocalElasticAgent.{a}" for a in AGENT_ATTRIBUTES if not hasattr(agent, a)]
    return gone


def pcontext(agent: LocalElasticAgent) -> SubprocessContext:
    """The agent's running process context; it must run a command (not a Python function)."""
    context: PContext | None = agent._pcontext
    if not isinstance(context, SubprocessContext):
        raise ConfigError(
            "trainguard launch runs a command per worker (python -u script.py); it cannot "
            f"replace one worker of a {type(context).__name__}: do not use --run-path"
        )
    return context


def handler(context: SubprocessContext, local_rank: int) -> SubprocessHandler:
    """The handler of ``local_rank``'s current process."""
    return context.subprocess_handlers[local_rank]


def kill_groups(
    context: SubprocessContext | None, local_ranks: Iterator[int] | list[int]
) -> list[int]:
    """SIGKILL the process group of each of ``local_ranks``' current process (those still
    known to ``context``); the pids signalled."""
    if context is None:
        return []
    killed = []
    for local_rank in local_ranks:
        try:
            pid = handler(context, local_rank).proc.pid
        except (KeyError, AttributeError):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


@dataclasses.dataclass(frozen=True)
class WorkerLaunch:
    """What torch used to start ``local_rank``'s first process."""

    entrypoint: str
    args: tuple[Any, ...]
    env: dict[str, str]
    stdout: str
    stderr: str
    error_file: str
    numa_options: Any


def launch_of(context: SubprocessContext, local_rank: int) -> WorkerLaunch:
    return WorkerLaunch(
        entrypoint=str(context.entrypoint),
        args=tuple(context.args[local_rank]),
        env=dict(context.envs[local_rank]),
        stdout=context.stdouts[local_rank],
        stderr=context.stderrs[local_rank],
        error_file=context.error_files[local_rank],
        numa_options=context._numa_options,
    )


def replace(
    context: SubprocessContext,
    local_rank: int,
    launch: WorkerLaunch,
) -> SubprocessHandler:
    """Start a new process for ``local_rank`` (torch's public ``get_subprocess_handler``: its
    own session, torch's command line and NUMA binding) and put it in the context in place of
    the old one, so that ``pids()`` and torch's ``close()`` see it."""
    new = get_subprocess_handler(
        launch.entrypoint,
        launch.args,
        launch.env,
        launch.stdout,
        launch.stderr,
        local_rank,
        launch.numa_options,
    )
    context.subprocess_handlers[local_rank] = new
    return new


def adopt(
    context: SubprocessContext, local_rank: int, proc: subprocess.Popen[bytes]
) -> SubprocessHandler:
    """Put ``proc`` (a process the agent started itself, leader of its own session, writing its
    own log files) in the context as ``local_rank``'s, in a handler that torch's ``close()``
    treats like its own (``killpg`` of ``proc.pid``; no log file of the agent to close)."""
    new = SubprocessHandler.__new__(SubprocessHandler)
    new.proc = proc
    new._stdout = None
    new._stderr = None
    new.local_rank_id = local_rank
    context.subprocess_handlers[local_rank] = new
    return new


def exit_code(handler: SubprocessHandler) -> int | None:
    """The exit code of ``handler``'s process as ``Popen.returncode`` has it (a signal as its
    negative number), None while it runs. Never reaps it: while the exited process is not
    reaped its pid, and so its process group's id, cannot be another process's
    (:func:`reap`)."""
    proc = handler.proc
    if proc.returncode is not None:
        return int(proc.returncode)
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere: Popen knows its code
        return proc.poll()
    if info is None:
        return None
    return int(info.si_status if info.si_code == os.CLD_EXITED else -info.si_status)


def reap(handler: SubprocessHandler, *, kill_group: bool) -> None:
    """Reap ``handler``'s exited process; with ``kill_group`` first kill whatever it left in
    its process group (its session leader is gone, not its children), while its pid is still
    its own (a pid signalled after the reap may be another process's)."""
    if kill_group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handler.proc.pid, signal.SIGKILL)
    handler.proc.wait()


def release(old: SubprocessHandler) -> None:
    """After ``old``'s process exited and was reaped (:func:`reap`): close the log files
    torch opened for it."""
    for name in ("_stdout", "_stderr"):
        stream = getattr(old, name, None)
        if stream is not None:
            stream.close()


def no_more_restarts(agent: LocalElasticAgent) -> None:
    """torch's loop ends the agent on its next FAILED result instead of restarting the job."""
    agent._remaining_restarts = 0


def check_uninterruptible(agent: LocalElasticAgent, group: WorkerGroup) -> RunResult | None:
    """torch's D-state watchdog (a worker stuck in uninterruptible sleep for longer than
    ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``), where this torch has it."""
    timeout = getattr(agent, "_uninterruptible_state_timeout", 0) or 0
    probe = getattr(agent, "_check_uninterruptible_state_timeout", None)
    if timeout <= 0 or probe is None:
        return None
    result: RunResult | None = probe(group, timeout)
    return result


@contextlib.contextmanager
def in_exit_barrier(agent: LocalElasticAgent) -> Iterator[None]:
    """Mark ``agent`` as waiting in its exit barrier (torch's health check then reports it
    alive although its workers ended), as torch's own exit barrier does."""
    agent._in_exit_barrier = True
    try:
        yield
    finally:
        agent._in_exit_barrier = False


def stop_keepalive(handler: object) -> None:
    """Stop a c10d rendezvous handler's keep-alive writes (torch restarts them at its next
    rendezvous round): its store went down with the node that hosted it, and each failed
    write would log a stack trace."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stop()
