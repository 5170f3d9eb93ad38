"""Temporary files nobody can plant: a symlink at any temporary name is never written through,
the final path is a regular file, and a temporary file is 0600 until it is complete."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import assert_same
from trainguard.checkpoint import (
    AsyncCheckpointer,
    LocalCheckpointManager,
    _commit,
    latest,
    load,
)
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.local import _inventory

SECRET = b"precious: must never be overwritten\n"


def _plant(at: Path, victim: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)


def _regular(path: Path) -> None:
    mode = os.lstat(path).st_mode
    assert stat.S_ISREG(mode), f"{path} is not a regular file"
    assert stat.S_IMODE(mode) == 0o644 & ~_umask(), oct(mode)


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


@pytest.mark.parametrize("format", ["trainguard", "torch"])
def test_a_planted_tmp_symlink_is_never_written_through(tmp_path: Path, format: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    target = tmp_path / "ckpt" / "step1"
    _plant(target.parent / "step1.tmp", victim)  # the old, predictable temporary name
    _plant(target.parent / ".step1.tmp", victim)
    state = {"w": torch.arange(1000.0), "step": 1}
    with AsyncCheckpointer() as ckpt:
        ckpt.save(state, target, format=format)
    assert victim.read_bytes() == SECRET
    _regular(target)
    assert_same(load(target), state)
    assert latest(target.parent) == target  # the planted links are no checkpoints


def test_the_commit_marker_ignores_a_planted_tmp_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    directory = tmp_path / "step1"
    _plant(directory / "COMMITTED.tmp", victim)
    marker = _commit._Marker(str(directory), {"world_size": 1, "format": "trainguard"})
    marker.prepare()
    marker.act()
    assert victim.read_bytes() == SECRET
    _regular(directory / "COMMITTED")
    assert sorted(p.name for p in directory.iterdir()) == ["COMMITTED", "COMMITTED.tmp"]


def test_local_parts_ignore_a_planted_tmp_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    root = tmp_path / "local"
    part = Path(_inventory.part_path(str(root), 5, 0, 0))
    _plant(Path(str(part) + ".tmp"), victim)
    state = {"w": torch.arange(100.0)}
    with LocalCheckpointManager(root) as mgr:
        mgr.save(state, 5)
        mgr.wait()
        assert mgr.find_latest() == 5
        assert_same(mgr.load(5), state)
    assert victim.read_bytes() == SECRET
    assert stat.S_ISREG(os.lstat(part).st_mode)


def test_temporary_names_are_unpredictable_private_and_skipped(tmp_path: Path) -> None:
    path = str(tmp_path / "part")
    opened = [tmpfile.create(path) for _ in range(2)]
    try:
        names = [tmp for _, tmp in opened]
        assert names[0] != names[1]
        for fd, tmp in opened:
            assert os.path.basename(tmp).startswith(".part.") and tmp.endswith(".tmp")
            assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600  # private until complete
        assert sorted(tmpfile.leftovers(path)) == sorted(names)
    finally:
        for fd, _ in opened:
            os.close(fd)
    tmpfile.remove_leftovers(path)
    assert os.listdir(tmp_path) == []
