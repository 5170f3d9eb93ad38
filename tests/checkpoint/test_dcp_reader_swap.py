"""Two ranks of one ``dcp.load`` never resume from different saves: a save swapped in after
rank 0 read the metadata and before rank 1 did (real ranks, a real swap) makes the load fail
on both with "load again"; the next load reads the new save on both."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests._dist import run_ranks
from trainguard.checkpoint import _overwrite
from trainguard.checkpoint.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step), "w": torch.full((64,), float(step))}


def _loaded(reader: StorageReader) -> int:
    target = {"step": torch.tensor(-1), "w": torch.zeros(64)}
    dcp.load(target, storage_reader=reader)
    step = int(target["step"])
    assert bool(target["w"].eq(float(step)).all()), f"step {step} with w = {target['w'][0]}"
    return step


def _two_ranks(root: str, hook: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    path, flag = os.path.join(root, "D"), os.path.join(root, "swapped")
    new = _overwrite.sibling(path, "0" * 16)

    def before() -> None:  # rank 1: only once rank 0 swapped save 2 in
        deadline = time.monotonic() + 30
        while rank == 1 and not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)

    def after() -> None:  # rank 0: swap save 2 in
        if rank == 0 and not os.path.exists(flag):
            _overwrite.swap(new, path)
            open(flag, "w").close()

    class Racing(StorageReader):
        """Rank 0 swaps save 2 in right after its ``hook`` step; rank 1 takes that step
        only then."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if hook == "metadata":
                before()
            metadata = super().read_metadata(*args, **kwargs)
            if hook == "metadata":
                after()
            return metadata

        def read_data(self, *args: Any, **kwargs: Any) -> Any:
            if hook == "data":
                before()
            done = super().read_data(*args, **kwargs)
            if hook == "data":
                after()
            return done

    out: dict[str, Any] = {}
    try:
        try:
            out["first"] = _loaded(Racing(path))
        except CheckpointException as exc:  # DCP's, a BaseException
            out["first"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        out["again"] = _loaded(StorageReader(path))
    finally:
        dist.destroy_process_group()
    return out


def _prepare(tmp_path: Path) -> None:
    """Save 1 at ``D``; save 2 committed beside it, where an overwrite's swap takes it from."""
    path, other = tmp_path / "D", tmp_path / "E"
    for where, step in ((path, 1), (other, 2)):
        with StorageWriter(where) as writer:
            dcp.save(_state(step), storage_writer=writer)
    os.rename(other, _overwrite.sibling(str(path), "0" * 16))


def test_ranks_that_read_different_saves_are_refused(tmp_path: Path) -> None:
    """The swap lands between the ranks' ``read_metadata``: refused, then both read save 2."""
    _prepare(tmp_path)
    args = (str(tmp_path), "metadata")
    results = [r.get() for r in run_ranks(_two_ranks, 2, args=args, timeout=120)]
    for rank, out in enumerate(results):
        assert "read different saves" in str(out["first"]), (rank, out)
        assert out["again"] == 2, (rank, out)


def test_a_swap_between_the_ranks_reads_changes_no_rank(tmp_path: Path) -> None:
    """The swap lands after rank 0 read its data and before rank 1 does: both read the save
    whose metadata they planned with (each reads through its descriptor of that directory),
    so both resume from save 1 (before the fix rank 1 read save 2's files)."""
    _prepare(tmp_path)
    args = (str(tmp_path), "data")
    results = [r.get() for r in run_ranks(_two_ranks, 2, args=args, timeout=120)]
    assert [out["first"] for out in results] == [1, 1], results
    assert [out["again"] for out in results] == [2, 2], results
