"""Save on preemption under ``trainguard launch``: a real SIGTERM to the launcher, which
forwards it to its 2 workers and waits for them to save instead of killing them."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests._dist import run_ranks
from tests.launch._agents import Agents, leftovers
from tests.restart._preempt_jobs import progress, train_job
from trainguard.checkpoint import latest, load
from trainguard.restart.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(240)

STEPS = 60


#: a sitecustomize for the launcher: at its exit, the names of the threads still alive
#: (daemon threads; the non-daemon ones were joined) go to a file of its pid
_THREADS_AT_EXIT = """\
import atexit, os, sys, threading
def _record():
    if sys.argv and sys.argv[0].endswith(os.path.join("launch", "__main__.py")):
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        with open(os.path.join({folder!r}, f"threads-{{os.getpid()}}"), "w") as f:
            f.write("\\n".join(names))
atexit.register(_record)
"""


def _job(tmp_path: Path, out: Path, name: str, env: dict[str, str] | None = None) -> Agents:
    folder = tmp_path / name
    folder.mkdir()
    return Agents(
        folder,
        nodes=1,
        nproc=2,
        worker=["preempt", str(out), f"--steps={STEPS}"],
        env=env,
        timeout=110,
    )


def _threads_at_exit(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder the launcher writes its threads at exit into, and the env that asks it to."""
    folder = tmp_path / "threads"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(_THREADS_AT_EXIT.format(folder=str(folder)))
    return folder, {"PYTHONPATH": str(folder)}


def test_sigterm_to_the_launcher_saves_one_step_exits_75_and_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    reference = [
        r.get()
        for r in run_ranks(
            train_job, 2, args=(str(tmp_path / "ref"),), kwargs={"steps": STEPS}, timeout=120
        )
    ]
    out = tmp_path / "out"
    out.mkdir()
    threads, env = _threads_at_exit(tmp_path)
    with _job(tmp_path, out, "first", env) as job:
        job.wait_for(
            lambda: all(any(p["step"] >= 23 for p in progress(out, r)) for r in (0, 1)),
            timeout=60,
            what="both workers past step 23",
        )
        job.signal(0, signal.SIGTERM)
        codes = job.wait(timeout=60)
        text = job.output()
        assert codes == [EXIT_PREEMPTED], text
        assert leftovers(job.run_id) == []
    assert "preempted; the workers saved their state" in text
    # torch's rendezvous keep-alive thread ended with the launcher's work: left running, its
    # store call could be under way as the interpreter exits, which aborts the launcher
    (left,) = [p.read_text().split() for p in threads.glob("threads-*")]
    assert not [name for name in left if name.startswith("RendezvousKeepAlive")], left
    assert "Traceback" not in text and "DistNetworkError" not in text
    newest = latest(out / "ckpt")
    assert newest is not None
    stop = load(newest, rank=0)["step"]
    assert stop > 23 and stop % 10  # the preemption's checkpoint, not a periodic one
    assert max(p["step"] for r in (0, 1) for p in progress(out, r)) == stop - 1
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "Traceback" not in logs

    with _job(tmp_path, out, "second") as job:
        assert job.wait(timeout=90) == [0], job.output()
    resumed = [json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert resumed == reference  # bit for bit


def test_the_grace_flag_reaches_the_options() -> None:
    from trainguard.launch.cli import build_parser, options_from_args

    args = build_parser().parse_args(["--tg-preemption-grace=90", "train.py"])
    assert options_from_args(args).preemption_grace == 90.0
