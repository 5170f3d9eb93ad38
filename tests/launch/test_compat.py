"""Contract test of the torch internals the agent relies on (``trainguard.launch._compat``).

If a torch release moves one of them, this test names it; the agent would otherwise fail in the
middle of a job, at the first worker death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from tests._dist import free_port
from trainguard.launch import LaunchOptions, TrainguardAgent, _compat
from trainguard.launch._logs import AgentLogsSpecs, incarnation_files

SLEEP = ("-c", "import time; time.sleep(60)")


def _agent(tmp_path: Path) -> TrainguardAgent:
    params = RendezvousParameters(
        backend="static",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="compat",
        min_nodes=1,
        max_nodes=1,
        rank=0,
    )
    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        entrypoint=sys.executable,
        args=SLEEP,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
    )
    return TrainguardAgent(
        spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), options=LaunchOptions()
    )


@pytest.fixture
def context(tmp_path: Path):
    logs = AgentLogsSpecs(DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))
    logs.extra_env = {"TRAINGUARD_INCARNATION": "0"}
    ctx = start_processes(
        name="compat",
        entrypoint=sys.executable,
        args={0: SLEEP, 1: SLEEP},
        envs={0: {"TORCHELASTIC_RUN_ID": "c"}, 1: {"TORCHELASTIC_RUN_ID": "c"}},
        logs_specs=logs,
    )
    assert isinstance(ctx, SubprocessContext)  # started; torch set its signal handlers
    yield ctx
    ctx.close(signal.SIGKILL, timeout=5)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def test_every_internal_the_agent_uses_is_there(tmp_path: Path, context: SubprocessContext):
    agent = _agent(tmp_path)
    gone = _compat.missing(context, context.subprocess_handlers[0], agent)
    assert gone == [], f"torch moved {gone}: update trainguard/launch/_compat.py"
    assert callable(getattr(agent, "_check_uninterruptible_state_timeout", None)), (
        "torch's D-state watchdog moved: _compat.check_uninterruptible no longer runs it"
    )


def test_our_env_reaches_the_workers_through_reify(context: SubprocessContext) -> None:
    for local_rank in (0, 1):
        launch = _compat.launch_of(context, local_rank)
        assert launch.env["TRAINGUARD_INCARNATION"] == "0"
        assert launch.env["TORCHELASTIC_ERROR_FILE"] == launch.error_file
        assert launch.stdout.endswith(f"{local_rank}/stdout.log")
        assert launch.entrypoint == sys.executable and launch.args == SLEEP


def test_replacing_one_process_leaves_the_other_and_torch_sees_the_new_one(
    context: SubprocessContext,
) -> None:
    old = _compat.handler(context, 0)
    other = context.pids()[1]
    assert _compat.exit_code(old) is None
    os.kill(old.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _compat.exit_code(old) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _compat.exit_code(old) == -signal.SIGKILL
    assert Path(f"/proc/{old.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    _compat.reap(old, kill_group=True)  # not reaped until then: its group's id stays its own
    assert old.proc.returncode == -signal.SIGKILL
    _compat.release(old)
    assert old._stdout is not None and old._stdout.closed
    first = _compat.launch_of(context, 0)
    files = incarnation_files(first.stdout, first.stderr, first.error_file, 1)
    assert files.stdout.endswith("/0/inc_1/stdout.log")
    new = _compat.replace(
        context,
        0,
        _compat.WorkerLaunch(
            first.entrypoint,
            ("-c", "print('second'); import time; time.sleep(60)"),
            first.env,
            files.stdout,
            files.stderr,
            files.error_file,
            first.numa_options,
        ),
    )
    assert context.pids() == {0: new.proc.pid, 1: other}
    assert os.getpgid(new.proc.pid) == new.proc.pid  # a session of its own, as torch's
    deadline = time.monotonic() + 10
    while "second" not in Path(files.stdout).read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "second" in Path(files.stdout).read_text()
    context.close(signal.SIGTERM, timeout=5)  # torch's close reaches the new process
    assert new.proc.poll() is not None and context.subprocess_handlers[1].proc.poll() is not None


def test_a_function_context_is_refused_with_the_fix(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    with pytest.raises(ValueError, match="--run-path"):
        _compat.pcontext(agent)


def test_an_adopted_process_is_one_torch_knows_and_closes(context: SubprocessContext) -> None:
    """A warm worker's process (started by the agent, not by torch's handler) in the context."""
    old = _compat.handler(context, 1)
    os.killpg(old.proc.pid, signal.SIGKILL)
    _compat.reap(old, kill_group=False)
    _compat.release(old)
    proc = subprocess.Popen([sys.executable, *SLEEP], start_new_session=True)
    new = _compat.adopt(context, 1, proc)
    assert context.pids()[1] == proc.pid and _compat.exit_code(new) is None
    context.close(signal.SIGTERM, timeout=5)  # torch's close: killpg of the adopted process
    assert proc.poll() == -signal.SIGTERM
