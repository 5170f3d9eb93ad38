"""Crash consistency: SIGKILL the writer, or the training process, at random points of saves.

After every kill the newest checkpoint that :func:`latest` finds must load, verify its
checksums and hold one consistent step; a ``.tmp`` file is never taken for a checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import AsyncCheckpointer, latest, load
from trainguard.errors import CheckpointWriteError


def _state(step: int) -> dict:
    return {
        "w": torch.full((1 << 21,), float(step)),  # 8 MiB
        "b": torch.arange(1000) + step,
        "small": [torch.full((3,), step, dtype=torch.int16) for _ in range(20)],
        "step": step,
    }


def _check_latest(root: Path) -> int | None:
    newest = latest(root)
    if newest is None:
        return None
    assert not newest.name.endswith(".tmp")
    state = load(newest, verify=True)
    step = state["step"]
    assert newest.name == f"step{step:05d}"
    assert torch.equal(state["w"], torch.full((1 << 21,), float(step)))
    assert torch.equal(state["b"], torch.arange(1000) + step)
    assert all(torch.equal(t, torch.full((3,), step, dtype=torch.int16)) for t in state["small"])
    return int(step)


def _live_writer(ckpt: AsyncCheckpointer) -> int:
    # a writer killed while idle is replaced by the next save, in the background
    deadline = time.monotonic() + 30
    while (pid := ckpt.writer_pid) is None or not ckpt._writer.alive():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return pid


def test_killing_the_writer_at_random_points(tmp_path: Path) -> None:
    rng = random.Random(1234)
    committed: list[int] = []
    failures = 0
    with AsyncCheckpointer(on_error="raise") as ckpt:
        for step in range(12):
            handle = ckpt.save(_state(step), tmp_path / f"step{step:05d}")
            time.sleep(rng.uniform(0.0, 0.06))
            os.kill(_live_writer(ckpt), signal.SIGKILL)
            try:
                ckpt.wait()
                committed.append(step)
            except CheckpointWriteError as exc:
                assert "writer process died" in str(exc)
                failures += 1
            assert handle is not None and handle.finished.is_set()
            assert not list(tmp_path.glob("*.tmp"))  # partial files are removed
            found = _check_latest(tmp_path)
            # Never older than the last save reported durable. A writer killed between its
            # rename and its reply leaves a complete file for a save that reported failure, so
            # the newest checkpoint may also be this step or an earlier "failed" one.
            floor = committed[-1] if committed else None
            if floor is not None:
                assert found is not None and floor <= found <= step
            else:
                assert found is None or found <= step
    assert failures >= 1, "no kill landed mid-write: the test proved nothing"


_TRAINER = """
import sys, torch
from trainguard.checkpoint import AsyncCheckpointer
sys.path.insert(0, sys.argv[2])
from tests.checkpoint.test_crash import _state
with AsyncCheckpointer() as ckpt:
    print(ckpt.writer_pid, flush=True)
    step = 0
    while True:
        ckpt.save(_state(step), f"{sys.argv[1]}/step{step:05d}", overlap=step % 2 == 1)
        ckpt.poll()
        step += 1
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("whole_group", [False, True], ids=["trainer", "trainer+writer"])
def test_killing_the_training_process_at_random_points(tmp_path: Path, whole_group: bool) -> None:
    rng = random.Random(99 + whole_group)
    repo = str(Path(__file__).resolve().parents[2])
    newest_steps = []
    for trial in range(5):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(root), repo],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            writer_pid = int(proc.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.8))
            if whole_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(30)
            deadline = time.monotonic() + 30
            while not _gone(writer_pid):  # an orphaned writer ends by itself
                assert time.monotonic() < deadline, "the writer outlived its trainer"
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        newest_steps.append(_check_latest(root))
    assert any(s is not None and s > 0 for s in newest_steps), newest_steps
