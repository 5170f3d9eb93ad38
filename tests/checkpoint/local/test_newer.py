"""LocalCheckpointManager never removes a complete iteration because an older one was loaded
(asked for, or a fallback because a read failed); a save of a kept number replaces it, and
``discard_newer`` rolls back explicitly."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainguard.checkpoint import LocalCheckpointManager


def _dirs(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("iter_")) for p in root.iterdir() if p.is_dir())


def _flip(path: Path, at: int) -> None:
    """Flip one bit of the byte at ``at`` of ``path`` (a second call flips it back)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
    finally:
        os.close(fd)


def _save(mgr: LocalCheckpointManager, *iterations: int, add: float = 0.0) -> None:
    for it in iterations:
        mgr.save({"w": torch.full((64,), it + add), "it": it}, it)
        mgr.wait()


def test_loading_an_older_iteration_keeps_the_newer_complete_ones(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=3) as mgr:
        _save(mgr, 5, 10)
        assert mgr.load(5)["it"] == 5
        assert _dirs(root) == [5, 10]
        assert mgr.find_latest() == 10
        assert mgr.load(10)["it"] == 10
        # saving a kept number again replaces it; discard_newer rolls back explicitly
        assert mgr.load(5)["it"] == 5
        _save(mgr, 10, add=0.5)
        assert mgr.find_latest() == 10
        assert float(mgr.load(10)["w"][0]) == 10.5
        assert mgr.load(5)["it"] == 5 and _dirs(root) == [5, 10]
        assert mgr.discard_newer(5) == [10]
        assert _dirs(root) == [5] and mgr.find_latest() == 5


def test_a_read_error_that_hides_a_newer_iteration_removes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=3) as mgr:
        _save(mgr, 5, 10)
        (part,) = (root / f"iter_{10:012d}").iterdir()
        at = part.stat().st_size - 1
        _flip(part, at)  # iteration 10's only part fails its checksum for now
        assert mgr.find_latest() == 5
        assert mgr.load(10)["it"] == 5  # the fallback, with a warning
        assert _dirs(root) == [5, 10]
        _flip(part, at)  # the read error is gone
        assert mgr.find_latest() == 10
        assert mgr.load(10)["it"] == 10


def test_an_unfinished_newer_iteration_is_still_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=3) as mgr:
        _save(mgr, 5)
        unfinished = root / f"iter_{10:012d}"
        unfinished.mkdir(mode=0o700)
        (unfinished / "owner00000.h00000.safetensors.tmp").write_bytes(b"partial")
        assert mgr.find_latest() == 5
        assert _dirs(root) == [5]


def _two_ranks_one_root(root: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from trainguard.checkpoint import CliqueReplication

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        with LocalCheckpointManager(
            root, replication=CliqueReplication(2, 1), keep=3, timeout=60
        ) as mgr:
            _save(mgr, 5, 10, add=rank)
            first = mgr.load(5)["it"]
            kept = _dirs(Path(root))
            dist.barrier()  # both listed the shared root before either replaces 10 in it
            _save(mgr, 10, add=rank + 0.5)  # replaces 10: every rank removes, a barrier, writes
            latest = mgr.find_latest()
            w = float(mgr.load(10)["w"][0])
            files = sorted(p.name for p in (Path(root) / f"iter_{10:012d}").iterdir())
            return {"first": first, "kept": kept, "latest": latest, "w": w, "files": files}
    finally:
        dist.destroy_process_group()


def test_two_ranks_sharing_a_root_save_a_kept_iteration_again(tmp_path: Path) -> None:
    from tests._dist import run_ranks

    root = tmp_path / "root"
    results = [r.get() for r in run_ranks(_two_ranks_one_root, 2, args=(str(root),))]
    for rank, got in enumerate(results):
        assert got["first"] == 5 and got["kept"] == [5, 10] and got["latest"] == 10
        assert got["w"] == 10 + rank + 0.5
        assert got["files"] == [
            f"owner{o:05d}.h{h:05d}.safetensors" for o in (0, 1) for h in (0, 1)
        ]
