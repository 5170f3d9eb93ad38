"""A failed background save never costs training progress (issue 33, item 4).

By default (``on_error="report"``) a save that fails after ``save()`` returned (a full disk, a
killed writer, a failed commit on another rank) is logged, counted in ``failures`` and emitted
as a ``ckpt_failure`` event; the training loop never sees an exception, the previous committed
checkpoint stays the latest and the next save writes normally. ``on_error="raise"`` keeps the
old behaviour. Real faults: a 1 MiB tmpfs (ENOSPC), SIGKILL of the writer process, a file in
the way of a local iteration's directory.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager, latest, load
from trainguard.errors import CheckpointWriteError, ConfigError


def test_disk_full_is_reported_and_training_goes_on(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with AsyncCheckpointer() as ckpt:
        ckpt.save({"w": torch.ones(1000)}, small_fs / "ok")
        ckpt.wait()
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            ckpt.save({"w": torch.ones(1 << 20)}, small_fs / "too_big")  # 4 MiB on 1 MiB
            ckpt.wait()  # reported, not raised
            ckpt.poll()
        assert [type(e) for e in ckpt.failures] == [CheckpointWriteError]
        assert "ENOSPC" in str(ckpt.failures[0])
        assert any("training goes on" in r.getMessage() for r in caplog.records)
        assert latest(small_fs) == small_fs / "ok"  # the previous checkpoint stays the latest
        ckpt.save({"w": torch.full((1000,), 2.0)}, small_fs / "next")  # the next save retries
        ckpt.wait()
        assert len(ckpt.failures) == 1
    assert latest(small_fs) == small_fs / "next"
    assert torch.equal(load(small_fs / "next")["w"], torch.full((1000,), 2.0))


def test_on_error_raise_keeps_raising(small_fs: Path) -> None:
    with AsyncCheckpointer(on_error="raise") as ckpt:
        ckpt.save({"w": torch.ones(1 << 20)}, small_fs / "too_big")
        with pytest.raises(CheckpointWriteError, match="ENOSPC"):
            ckpt.wait()
        assert ckpt.failures == []


def test_a_bad_on_error_is_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"on_error='ignore'.*'report'.*'raise'"):
        AsyncCheckpointer(on_error="ignore")
    with pytest.raises(ConfigError, match="on_error="):
        LocalCheckpointManager(tmp_path / "root", on_error="warn")


def test_a_killed_writer_costs_no_step(tmp_path: Path) -> None:
    """A training loop that saves every few steps and polls every step runs to its end while
    the writer is SIGKILLed under a save: no exception reaches it."""
    w = torch.zeros(1 << 18)
    killed = None
    with AsyncCheckpointer() as ckpt:
        for step in range(12):
            w += 1  # the "training step"
            ckpt.poll()
            if step % 4 == 3:
                ckpt.save({"w": w, "step": step}, tmp_path / f"step{step}")
            if step == 7:  # the save of step 7 is in flight: kill the writer under it
                killed = ckpt.writer_pid
                assert killed is not None
                os.kill(killed, signal.SIGKILL)
                time.sleep(0.2)
        ckpt.wait()
        assert ckpt.writer_pid not in (None, killed)  # replaced for the next save
        failures = list(ckpt.failures)
    assert float(w[0]) == 12.0
    assert latest(tmp_path) == tmp_path / "step11"
    assert load(tmp_path / "step11")["step"] == 11
    assert os.path.exists(tmp_path / "step3")
    # the save under the kill either failed (and was reported) or had finished before it
    assert len(failures) <= 1
    if failures:
        assert not os.path.exists(tmp_path / "step7")


def test_a_failed_local_iteration_is_reported_and_the_next_one_saves(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=2) as mgr:
        mgr.save({"w": torch.full((4096,), 1.0), "it": 1}, 1)
        mgr.wait()
        (root / f"iter_{2:012d}").write_text("not a directory")  # iteration 2 will fail
        mgr.save({"w": torch.full((4096,), 2.0), "it": 2}, 2)
        mgr.wait()  # reported, not raised
        assert len(mgr.failures) == 1 and isinstance(mgr.failures[0], CheckpointWriteError)
        assert mgr.find_latest() == 1
        mgr.save({"w": torch.full((4096,), 3.0), "it": 3}, 3)
        mgr.wait()
        assert mgr.find_latest() == 3 and mgr.load(3)["it"] == 3
        assert len(mgr.failures) == 1
    with LocalCheckpointManager(tmp_path / "raising", on_error="raise") as mgr:
        (tmp_path / "raising" / f"iter_{5:012d}").write_text("in the way")
        mgr.save({"w": torch.zeros(8)}, 5)
        with pytest.raises(CheckpointWriteError):
            mgr.wait()


def _two_ranks(root: str) -> dict[str, object]:
    """Rank 1's writer is SIGKILLed under the second save: on both ranks that save fails and
    is reported, the loop goes on, and the third save commits."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    out: dict[str, object] = {}
    try:
        with AsyncCheckpointer(commit_timeout=30) as ckpt:
            for n in (1, 2, 3):
                state = {"w": torch.full((1 << 16,), float(10 * n + rank))}
                if n == 2 and rank == 1:
                    pid = ckpt.writer_pid
                    assert pid is not None
                    os.kill(pid, signal.SIGSTOP)  # hold it, so the kill lands under the save
                    ckpt.save(state, f"{root}/ckpt{n}")
                    time.sleep(0.3)
                    os.kill(pid, signal.SIGKILL)
                else:
                    ckpt.save(state, f"{root}/ckpt{n}")
                ckpt.wait()
                dist.barrier()
            out["failures"] = [str(e) for e in ckpt.failures]
    finally:
        dist.destroy_process_group()
    return out


def test_a_rank_whose_writer_dies_fails_the_save_everywhere_and_nobody_raises(
    tmp_path: Path,
) -> None:
    results = [r.get() for r in run_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=150)]
    for out in results:
        assert len(out["failures"]) == 1, out  # type: ignore[arg-type]
    assert "writer process died" in results[1]["failures"][0]  # type: ignore[index]
    assert latest(tmp_path) == tmp_path / "ckpt3"
    assert not (tmp_path / "ckpt2" / "COMMITTED").exists()
    assert float(load(tmp_path / "ckpt3", rank=1)["w"][0]) == 31.0
