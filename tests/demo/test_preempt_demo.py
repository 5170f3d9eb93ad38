"""``trainguard demo`` with a ``preempt`` fault (SIGTERM to every process of the job), then
``--resume``: the run ends bit-identical to the fault-free run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.demo.test_demo import SOFT_TIMEOUT, run_demo
from trainguard.checkpoint import latest, load
from trainguard.restart.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(600)


def test_a_preempted_demo_saves_one_step_and_its_resumed_run_is_bit_identical(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    first = run_demo(
        out, "--ranks", "2", "--spares", "1", "--steps", "60", "--local-every", "5",
        "--disk-every", "20", "--soft-timeout", str(SOFT_TIMEOUT),
        "--faults", "exception@12:1,preempt@33:0",
    )  # fmt: skip
    text = first.stdout + first.stderr
    assert first.returncode == EXIT_PREEMPTED, text
    found = re.search(r"preempted: every rank stopped at step (\d+) and saved it", first.stdout)
    assert found, text
    stop = int(found.group(1))
    assert stop > 33
    newest = latest(out / "ckpt")
    assert newest is not None and load(newest, rank=0)["step"] == stop
    for log in (out / "logs").glob("*.log"):  # the exception fault's round logs its own
        text = log.read_text().split("SIGTERM: preemption", 1)
        assert len(text) == 2, log  # every process noticed the signal
        assert "Traceback" not in text[1] and "DistNetworkError" not in text[1], log

    again = run_demo(out, "--resume", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "bit-identical: yes" in again.stdout
    assert (out / "events-resumed").is_dir()
