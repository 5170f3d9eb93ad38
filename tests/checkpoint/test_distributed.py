"""Multi-rank checkpoints with gloo and the default TCPStore, through tests/_dist.py.

A checkpoint is committed only after every rank's part is durable; one rank's failure fails it
on every rank, the same way, and the next checkpoint works again.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests._dist import run_ranks


def _setup():
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist, dist.get_rank(), dist.get_world_size(), dist.distributed_c10d._get_default_store()


def _state(rank: int, step: int):
    import torch

    return {"w": torch.full((1 << 16,), float(rank * 100 + step)), "rank": rank, "step": step}


def _wait_count(store, key: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while store.add(key, 0) < n:
        assert time.monotonic() < deadline, f"{key} never reached {n}"
        time.sleep(0.01)


def _commit_waits_for_every_part(root: str, slow_rank: int) -> dict:
    import torch

    from trainguard.checkpoint import AsyncCheckpointer, latest, load

    dist, rank, world, store = _setup()
    marker = Path(root, "step1", "COMMITTED")
    seen: dict = {}
    committed: list[str] = []
    try:
        with AsyncCheckpointer(commit_timeout=60) as ckpt:
            if rank == slow_rank:
                os.kill(ckpt.writer_pid, signal.SIGSTOP)  # this rank's part is late
            handle = ckpt.save(
                _state(rank, 1), f"{root}/step1", on_commit=lambda i: committed.append(i.path)
            )
            assert handle is not None
            if rank != slow_rank:
                assert handle.written.wait(30)  # our own part is durable...
                time.sleep(0.3)
                ckpt.poll()
                seen["before"] = (handle.committed, marker.exists(), list(committed))
                store.add("checked", 1)
            else:
                _wait_count(store, "checked", world - 1)
                os.kill(ckpt.writer_pid, signal.SIGCONT)
            ckpt.wait()
            seen["after"] = (handle.committed, marker.exists(), list(committed))
            ckpt.save(_state(rank, 2), f"{root}/step2")
            ckpt.wait()
        back = load(f"{root}/step2")
        assert back["rank"] == rank and torch.equal(back["w"], _state(rank, 2)["w"])
        seen["latest"] = str(latest(root))
        seen["parts"] = sorted(os.listdir(f"{root}/step2"))
    finally:
        dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("world_size", [2, 4])
def test_commit_only_after_every_part_is_durable(tmp_path: Path, world_size: int) -> None:
    slow = world_size - 1
    results = [
        r.get()
        for r in run_ranks(
            _commit_waits_for_every_part, world_size, args=(str(tmp_path), slow), timeout=150
        )
    ]
    for rank, seen in enumerate(results):
        if rank != slow:
            assert seen["before"] == (False, False, []), (rank, seen)
        assert seen["after"] == (True, True, [str(tmp_path / "step1")]), (rank, seen)
        assert seen["latest"] == str(tmp_path / "step2")
        assert seen["parts"] == ["COMMITTED"] + [
            f"rank{r:05d}.safetensors" for r in range(world_size)
        ]


def _one_rank_fails(root: str, bad_rank: int) -> dict:
    from trainguard.checkpoint import AsyncCheckpointer, latest, load
    from trainguard.errors import CheckpointUncommittedError, CheckpointWriteError

    dist, rank, world, store = _setup()
    out: dict = {}
    try:
        with AsyncCheckpointer(commit_timeout=60, on_error="raise") as ckpt:
            ckpt.save(_state(rank, 1), f"{root}/step1")
            ckpt.wait()
            if rank == bad_rank:
                pid = ckpt.writer_pid
                os.kill(pid, signal.SIGSTOP)
                ckpt.save(_state(rank, 2), f"{root}/step2")
                time.sleep(0.5)  # let the background thread hand the job to the stopped writer
                os.kill(pid, signal.SIGKILL)
            else:
                ckpt.save(_state(rank, 2), f"{root}/step2")
            try:
                ckpt.wait()
                out["error"] = None
            except CheckpointWriteError as exc:
                out["error"] = (type(exc).__name__, exc.causes)
            store.add("failed-seen", 1)
            _wait_count(store, "failed-seen", world)  # every rank has cleaned up its part
            out["files"] = sorted(os.listdir(f"{root}/step2"))
            try:
                load(f"{root}/step2")
            except CheckpointUncommittedError:
                out["refused"] = True
            out["latest_after_failure"] = str(latest(root))
            ckpt.save(_state(rank, 3), f"{root}/step3")
            ckpt.wait()
            out["latest"] = str(latest(root))
            out["step3"] = load(f"{root}/step3")["step"]
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_failing_fails_the_commit_everywhere(tmp_path: Path, world_size: int) -> None:
    bad = 1
    results = [
        r.get()
        for r in run_ranks(_one_rank_fails, world_size, args=(str(tmp_path), bad), timeout=150)
    ]
    errors = [r["error"] for r in results]
    assert all(e is not None for e in errors), errors
    assert all(e == errors[0] for e in errors), errors  # the same error on every rank
    name, causes = errors[0]
    assert name == "CheckpointWriteError" and list(causes) == [bad]
    assert "writer process died" in causes[bad]
    for r in results:
        assert r["files"] == [] and r["refused"] is True
        assert r["latest_after_failure"] == str(tmp_path / "step1")
        assert r["latest"] == str(tmp_path / "step3") and r["step3"] == 3


def _one_rank_skips(root: str) -> dict:
    from trainguard.checkpoint import AsyncCheckpointer, latest
    from trainguard.errors import CheckpointWriteError

    dist, rank, _, _ = _setup()
    out: dict = {}
    try:
        with AsyncCheckpointer(commit_timeout=60, on_error="raise") as ckpt:
            if rank == 1:
                os.kill(ckpt.writer_pid, signal.SIGSTOP)  # rank 1 is still writing step1...
            started = time.monotonic()
            first = ckpt.save(_state(rank, 1), f"{root}/step1")
            if rank == 0:
                assert first is not None and first.written.wait(30)  # ...rank 0 is not
            out["step2"] = ckpt.save(_state(rank, 2), f"{root}/step2", if_busy="skip") is not None
            if rank == 1:
                time.sleep(0.3)
                os.kill(ckpt.writer_pid, signal.SIGCONT)
            try:
                ckpt.wait()
                out["error"] = None
            except CheckpointWriteError as exc:
                out["error"] = exc.causes
            ckpt.save(_state(rank, 3), f"{root}/step3")  # the ranks agree again
            ckpt.wait()
            out["seconds"] = time.monotonic() - started  # no wait for a commit timeout (60 s)
            out["latest"] = str(latest(root))
    finally:
        dist.destroy_process_group()
    return out


def test_a_rank_that_skips_fails_that_checkpoint_on_the_others(tmp_path: Path) -> None:
    r0, r1 = (r.get() for r in run_ranks(_one_rank_skips, 2, args=(str(tmp_path),), timeout=150))
    assert r0["step2"] is True and r1["step2"] is False
    assert list(r0["error"]) == [1] and "skipped" in r0["error"][1]
    assert r1["error"] is None  # it knew: save() returned None
    assert (tmp_path / "step1" / "COMMITTED").exists()
    assert not (tmp_path / "step2" / "COMMITTED").exists()
    assert r0["latest"] == r1["latest"] == str(tmp_path / "step3")
    assert r0["seconds"] < 30 and r1["seconds"] < 30, (r0, r1)


def _abandon_while_a_rank_is_late(root: str) -> dict:
    from trainguard.checkpoint import AsyncCheckpointer, latest
    from trainguard.errors import CheckpointWriteError

    dist, rank, _, store = _setup()
    out: dict = {}
    try:
        ckpt = AsyncCheckpointer(commit_timeout=60, on_error="raise")
        ckpt.save(_state(rank, 1), f"{root}/step1")
        ckpt.wait()
        if rank == 1:
            os.kill(ckpt.writer_pid, signal.SIGSTOP)  # rank 1's part of step2 is late
        handle = ckpt.save(_state(rank, 2), f"{root}/step2")
        assert handle is not None
        if rank == 0:
            assert handle.written.wait(30)  # our part is durable; the commit waits for rank 1
            started = time.monotonic()
            ckpt.close(abandon=True)  # e.g. a restart's finalize hook: rank 1 may be dead
            out["close_seconds"] = time.monotonic() - started
            out["handle_error"] = handle.error.causes if handle.error else None
            store.set("abandoned", "1")
            # This rank hosts the store: keep it up until rank 1 has its outcome (rank 1's
            # report after SIGCONT would otherwise meet a closed store, not the abandon).
            store.wait(["r1_done"], timedelta(seconds=60))
        else:
            store.wait(["abandoned"], timedelta(seconds=60))
            os.kill(ckpt.writer_pid, signal.SIGCONT)
            try:
                ckpt.wait()
                out["error"] = None
            except CheckpointWriteError as exc:
                out["error"] = exc.causes
            ckpt.close()
            store.set("r1_done", "1")
        out["latest"] = str(latest(root))
    finally:
        dist.destroy_process_group()
    return out


def test_close_abandon_fails_a_pending_commit_at_once_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = (
        r.get()
        for r in run_ranks(_abandon_while_a_rank_is_late, 2, args=(str(tmp_path),), timeout=150)
    )
    assert r0["close_seconds"] < 10, r0  # not the 60 s commit timeout
    assert list(r0["handle_error"]) == [0] and "abandon" in r0["handle_error"][0]
    assert list(r1["error"]) == [0] and "abandon" in r1["error"][0]
    assert (tmp_path / "step1" / "COMMITTED").exists()
    assert not (tmp_path / "step2" / "COMMITTED").exists()
    assert r0["latest"] == r1["latest"] == str(tmp_path / "step1")


class _LateReports:
    """A store client of one rank whose commit reports arrive ``delay`` seconds late: the rank
    is alive, just slower than the others' commit_timeout."""

    def __init__(self, store, delay: list[float]) -> None:
        self._store, self._delay = store, delay

    def clone(self):
        return _LateReports(self._store.clone(), self._delay)

    def set(self, key: str, value) -> None:
        if "/done/" in key:  # the first step of a report
            time.sleep(self._delay[0])
        self._store.set(key, value)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_late_rank_cannot_commit_what_a_timed_out_rank_gave_up(tmp_path: Path) -> None:
    """Rank 0 waits commit_timeout for rank 1's report, gives up and removes its part. Rank 1's
    report then completes the count: it must not write COMMITTED (the directory would lack rank
    0's part); the outcome "failed" was decided once, by rank 0, for both (issue 12, item 1)."""
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint import AsyncCheckpointer, latest, load
    from trainguard.errors import CheckpointWriteError

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    delay = [0.0]
    r0 = AsyncCheckpointer(store=store, rank=0, world_size=2, commit_timeout=1, on_error="raise")
    r1 = AsyncCheckpointer(
        store=_LateReports(store, delay), rank=1, world_size=2, commit_timeout=1, on_error="raise"
    )
    with r0, r1:
        for rank, ckpt in enumerate((r0, r1)):
            ckpt.save(_state(rank, 1), tmp_path / "step1")
        r0.wait()
        r1.wait()
        delay[0] = 3.0  # rank 1's report of step2 lands 2 s after rank 0 gave up
        for rank, ckpt in enumerate((r0, r1)):
            ckpt.save(_state(rank, 2), tmp_path / "step2")
        errors = []
        for ckpt in (r0, r1):
            with pytest.raises(CheckpointWriteError) as err:
                ckpt.wait()
            errors.append(err.value.causes)
    assert errors[0] == errors[1] and list(errors[0]) == [1], errors
    assert "did not report" in errors[0][1]
    assert not (tmp_path / "step2" / "COMMITTED").exists()
    assert not (tmp_path / "step2" / "COMMITTED.tmp").exists()
    assert os.listdir(tmp_path / "step2") == []  # decided "failed": no rank keeps its part
    assert latest(tmp_path) == tmp_path / "step1"
    assert torch.equal(load(tmp_path / "step1", rank=1)["w"], _state(1, 1)["w"])
