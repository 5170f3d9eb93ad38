"""Plain torchrun's whole-job restart (``--max-restarts``) with the Wrapper: the restarted
attempt uses keys of its own, so nothing of the killed attempt is on its path."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests._dist import free_port

WORKER = Path(__file__).with_name("_torchrun_worker.py")
STEPS = 5


def test_torchrun_restart_after_a_worker_sigkill_completes(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        str(WORKER),
        str(tmp_path),
        str(STEPS),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MASTER_PORT": str(free_port())}
    env.pop("TRAINGUARD_JOB_ID", None)
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(
            "torchrun did not finish within 90 s:\n" + output.decode()[-4000:]
        ) from exc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the job left in its session
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    # sum over steps of (step + 0) + (step + 1), the same on both ranks
    expected = float(sum(2 * s + 1 for s in range(STEPS)))
    for rank in (0, 1):
        assert float((tmp_path / f"done-1-{rank}").read_text()) == expected, text[-4000:]
    assert not (tmp_path / "done-0-1").exists()


def test_job_token_names_the_attempt_or_generation() -> None:
    import pytest

    from trainguard.errors import ConfigError
    from trainguard.restart._environment import detect

    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    assert detect(base).job == "h-1234"
    torchrun = {**base, "TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert detect(torchrun).job == "run-a3"
    launched = {**torchrun, "TRAINGUARD_GENERATION": "2", "TRAINGUARD_INCARNATION": "4"}
    assert (detect(launched).job, detect(launched).incarnation) == ("run-g2", 4)
    assert detect(base).incarnation == 0
    with pytest.raises(ConfigError, match="TRAINGUARD_INCARNATION"):
        detect({**base, "TRAINGUARD_INCARNATION": "x"})
