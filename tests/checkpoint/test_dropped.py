"""Checkpointers dropped without close() release their writer process, threads and staging
memory once they are garbage-collected (the ``no_leaks`` fixture checks threads, child
processes, memfds, mappings and fds after the test)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import torch

from tests.checkpoint.conftest import assert_same
from tests.checkpoint.test_async import _gone
from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager, load


def _settle(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until the writers are gone and no trainguard thread is left (a release that ran on
    one of the checkpointer's own threads finishes on a thread of its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        ours = [t.name for t in threading.enumerate() if t.name.startswith("trainguard")]
        if not ours and all(_gone(p) for p in pids):
            return
        time.sleep(0.05)
    raise AssertionError(f"still there after {timeout} s: threads {ours}, writers {pids}")


def test_a_dropped_async_checkpointer_releases_everything(tmp_path: Path, no_leaks) -> None:
    state = {"w": torch.randn(1 << 18), "step": 1}
    pids = []
    for i in range(3):  # like a job that creates one every restart round and never closes it
        ckpt = AsyncCheckpointer()
        ckpt.save(state, tmp_path / f"s{i}")
        ckpt.wait()
        assert ckpt.writer_pid is not None
        pids.append(ckpt.writer_pid)
        del ckpt
        gc.collect()
    _settle(pids)
    assert_same(load(tmp_path / "s2"), state)


def test_a_checkpointer_dropped_with_a_pending_save_still_writes_it(
    tmp_path: Path, no_leaks
) -> None:
    state = {"w": torch.randn(1 << 20)}
    ckpt = AsyncCheckpointer()
    pid = ckpt.writer_pid
    assert pid is not None
    ckpt.save(state, tmp_path / "pending")
    del ckpt  # the background thread holds it until the save is written, then lets it go
    _settle([pid])
    assert_same(load(tmp_path / "pending"), state)


def test_a_dropped_local_manager_releases_everything(tmp_path: Path, no_leaks) -> None:
    state = {"w": torch.randn(1 << 18)}
    mgr = LocalCheckpointManager(tmp_path / "local")
    mgr.save(state, 1)
    mgr.wait()
    pid = mgr._writer.pid
    assert pid is not None
    del mgr
    gc.collect()
    _settle([pid])
    with LocalCheckpointManager(tmp_path / "local") as again:
        assert again.find_latest() == 1
        assert_same(again.load(1), state)
