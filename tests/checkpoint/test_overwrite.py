"""Safe overwrite: a save to a committed checkpoint is written beside it and swapped in once
committed, by DCP's StorageWriter and by AsyncCheckpointer alike. A SIGKILL at each step of the
swap (TRAINGUARD_OVERWRITE_KILL_AT) leaves one complete checkpoint at the path, the old or the
new one, which ``latest``/``load`` return; the next save finishes or cleans what was left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import TCPStore
from torch.distributed.checkpoint.api import CheckpointException

from tests._dist import run_ranks
from trainguard.checkpoint import AsyncCheckpointer, latest, load
from trainguard.checkpoint.dcp import StorageReader, StorageWriter
from trainguard.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 32), float(step)), "step": torch.tensor(step)}


def _dcp_step(path: Path) -> int:
    target = {"w": torch.zeros(64, 32), "step": torch.tensor(-1)}
    dcp.load(target, storage_reader=StorageReader(path))
    step = int(target["step"])
    assert torch.equal(target["w"], torch.full((64, 32), float(step)))  # one save, not a mix
    return step


def _only(root: Path, name: str) -> None:
    assert sorted(os.listdir(root)) == [name], "leftovers of the swap remain"


def test_dcp_save_overwrites_a_committed_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with StorageWriter(path) as writer:
        dcp.save(_state(1), storage_writer=writer)
        dcp.save(_state(2), storage_writer=writer)  # torch's default: overwrite=True
        assert _dcp_step(path) == 2
        dcp.save(_state(3), checkpoint_id=path, storage_writer=writer)
    assert _dcp_step(path) == 3 and latest(tmp_path) == path
    _only(tmp_path, "ckpt")
    with (
        StorageWriter(path, overwrite=False) as writer,
        pytest.raises(CheckpointException, match="already a committed checkpoint"),
    ):
        dcp.save(_state(4), storage_writer=writer)
    assert _dcp_step(path) == 3


_CHILD = """
import os, sys, torch, torch.distributed.checkpoint as dcp
from trainguard.checkpoint import AsyncCheckpointer
from trainguard.checkpoint.dcp import StorageWriter
kind, path, point, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
state = lambda step: {"w": torch.full((64, 32), float(step)), "step": torch.tensor(step)}
if kind.startswith("dcp"):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    cached = kind == "dcp-cached"  # a planner that reuses its first plan
    planner = lambda: DefaultSavePlanner(enable_plan_caching=cached)
    writer = StorageWriter(path)
    dcp.save(state(1), storage_writer=writer, planner=planner())
    print(writer._writer.pid, flush=True)
    os.environ["TRAINGUARD_OVERWRITE_KILL_AT"] = point
    dcp.save(state(2), storage_writer=writer, planner=planner())
else:
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", port, None, is_master=False)
    ckpt = AsyncCheckpointer(store=store, rank=0, world_size=1, commit_timeout=60)
    ckpt.save(state(1), path)
    ckpt.wait()
    print(ckpt.writer_pid, flush=True)
    os.environ["TRAINGUARD_OVERWRITE_KILL_AT"] = point
    ckpt.save(state(2), path)
    ckpt.wait()
print("not killed", flush=True)
"""


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _run_killed(kind: str, path: Path, point: str, port: int = 0) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_OVERWRITE_KILL_AT"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(path), point, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr[-3000:])
    writer_pid = int(done.stdout.split()[0])
    assert _gone(writer_pid), "the writer process outlived the killed trainer"


#: the step at the path after a kill at each point: the old one until the new one is moved in
_DCP_POINTS = {"uncommitted": 1, "committed": 1, "old-moved": 2, "new-moved": 2}


@pytest.mark.parametrize("point", sorted(_DCP_POINTS))
@pytest.mark.parametrize("planner", ["dcp", "dcp-cached"])
def test_dcp_overwrite_survives_sigkill_at_each_step(
    tmp_path: Path, point: str, planner: str
) -> None:
    path = tmp_path / "ckpt"
    _run_killed(planner, path, point)
    assert latest(tmp_path) == path
    assert _dcp_step(path) == _DCP_POINTS[point]
    # the next save finishes or cleans up what the crash left, then overwrites
    with StorageWriter(path) as writer:
        dcp.save(_state(3), storage_writer=writer)
    assert _dcp_step(path) == 3
    _only(tmp_path, "ckpt")


_ASYNC_POINTS = {"committed": 1, "old-moved": 2, "new-moved": 2}


def _async_step(path: Path) -> int:
    state = load(path, rank=0)
    step = int(state["step"])
    assert torch.equal(state["w"], torch.full((64, 32), float(step)))
    return step


@pytest.mark.parametrize("point", sorted(_ASYNC_POINTS))
def test_async_overwrite_survives_sigkill_at_each_step(tmp_path: Path, point: str) -> None:
    path = tmp_path / "ckpt"
    store = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60))
    try:
        _run_killed("async", path, point, store.port)
        assert latest(tmp_path) == path
        assert _async_step(path) == _ASYNC_POINTS[point]
        with AsyncCheckpointer(store=store, rank=0, world_size=1, key_prefix="again") as ckpt:
            ckpt.save(_state(3), path)
            ckpt.wait()
        assert _async_step(path) == 3
        _only(tmp_path, "ckpt")
    finally:
        del store


def _two_ranks(root: str) -> dict[str, object]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    path = f"{root}/ckpt"
    out: dict[str, object] = {}
    try:
        with AsyncCheckpointer(commit_timeout=60, on_error="raise") as ckpt:
            for step in (1, 2, 3):
                ckpt.save({"w": torch.full((8,), float(10 * step + rank))}, path)
                ckpt.wait()
                dist.barrier()
                out[f"step{step}"] = float(load(path)["w"][0])
            out["entries"] = sorted(os.listdir(root))
            dist.barrier()  # every rank listed before any starts the next save (its sibling)
            # a save that fails on one rank (an object JSON cannot hold) changes nothing there
            bad = {"w": object()} if rank == 1 else {"w": torch.full((8,), -1.0)}
            try:
                ckpt.save(bad, path)
                ckpt.wait()
            except CheckpointError as exc:
                out["failed"] = type(exc).__name__
            dist.barrier()
            out["after_failure"] = float(load(path)["w"][0])
            ckpt.save({"w": torch.full((8,), float(40 + rank))}, path)  # cleans what it left
            ckpt.wait()
            dist.barrier()
            out["step4"] = float(load(path)["w"][0])
            out["entries_after"] = sorted(os.listdir(root))
            dist.barrier()
        with AsyncCheckpointer(commit_timeout=60, overwrite=False) as ckpt:
            try:
                ckpt.save({"w": torch.zeros(8)}, path)
            except CheckpointError as exc:
                out["refused"] = str(exc)
            dist.barrier()
            out["kept"] = float(load(path)["w"][0])
    finally:
        dist.destroy_process_group()
    return out


def test_async_checkpointer_overwrites_on_every_rank(tmp_path: Path) -> None:
    results = [r.get() for r in run_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=150)]
    for rank, out in enumerate(results):
        assert [out[f"step{s}"] for s in (1, 2, 3)] == [10 + rank, 20 + rank, 30 + rank], out
        assert out["entries"] == ["ckpt"], out
        assert out["failed"] and out["after_failure"] == 30 + rank, out
        assert out["step4"] == 40 + rank and out["entries_after"] == ["ckpt"], out
        assert "already a committed checkpoint" in str(out["refused"]), out
        assert out["kept"] == 40 + rank
