"""Local roots nobody else can read or plant files in, and iteration numbers of any size: roots
and iteration directories are created 0700 and parts written 0600; a root owned by another user,
writable by group or others, or that is a file is refused when the manager is built; the scan
opens only regular files (never a FIFO, device or symlink) and never blocks; iterations up to
2**63 - 1 are found again."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import LocalCheckpointManager
from trainguard.checkpoint.local import _root
from trainguard.errors import ConfigError

_BIG = (10**12, 2**63 - 1)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _state(it: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(it % 1000)), "it": it}


def _save_durably(mgr: LocalCheckpointManager, *iterations: int) -> None:
    for it in iterations:
        mgr.save(_state(it), it)
        mgr.wait()


def test_iterations_beyond_twelve_digits_are_found_and_retained(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=1, timeout=60) as mgr:
        mgr.save(_state(5), 5)
        mgr.wait()
        for it in _BIG:
            mgr.save(_state(it), it)
            mgr.wait()
            assert mgr.find_latest() == it
            assert mgr.load(it)["it"] == it
        assert sorted(os.listdir(root)) == [f"iter_{2**63 - 1}"]
        for bad in (2**63, -1, 2**64):
            with pytest.raises(ConfigError, match="2\\*\\*63 - 1"):
                mgr.save(_state(0), bad)


def test_retention_counts_only_iterations_the_scan_sees(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=2, timeout=60) as mgr:
        _save_durably(mgr, 1, 2)
        shutil.rmtree(root / "iter_000000000002")  # lost (by hand, or a cleaner)
        mgr.save(_state(3), 3)
        mgr.wait()
        assert sorted(os.listdir(root)) == ["iter_000000000001", "iter_000000000003"]
        assert mgr.find_latest() == 3


def test_existing_twelve_digit_names_are_still_found(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=2, timeout=60) as mgr:
        _save_durably(mgr, 7)
    assert os.listdir(root) == ["iter_000000000007"]
    # a name this library never writes (13 digits for a small number) is not an iteration
    shutil.copytree(root / "iter_000000000007", root / "iter_0000000000008")
    with LocalCheckpointManager(root, keep=2, timeout=60) as mgr:
        assert mgr.find_latest() == 7
        assert mgr.load(7)["it"] == 7


def test_roots_iteration_directories_and_parts_are_private(tmp_path: Path) -> None:
    shared = tmp_path / "shm"  # like /dev/shm: world-writable and sticky; its mode is fine
    shared.mkdir()
    shared.chmod(0o1777)
    root = shared / "a" / "b"
    with LocalCheckpointManager(root, timeout=60) as mgr:
        mgr.save(_state(1), 1)
        mgr.wait()
    assert _mode(shared) == 0o1777
    assert _mode(shared / "a") == _mode(root) == 0o700
    assert _mode(root / "iter_000000000001") == 0o700
    (part,) = (root / "iter_000000000001").iterdir()
    assert _mode(part) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720, 0o702])
def test_a_root_others_may_write_in_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(ConfigError, match=f"{root}.*chmod 700 {root}"):
        LocalCheckpointManager(root)
    assert os.listdir(root) == []


def test_a_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    other = os.geteuid() + 4242
    why = _root.problem(str(root), os.stat(root), uid=other)
    assert why is not None and f"owned by uid {os.geteuid()}" in why and "chown" in why
    assert _root.problem(str(root), os.stat(root), uid=os.geteuid()) is None
    if os.geteuid() != 0:
        return  # a directory of another user cannot be made without root (the check is above)
    os.chown(root, other, other)
    with pytest.raises(ConfigError, match=f"{root} is owned by uid {other}"):
        LocalCheckpointManager(root)
    # a symlink planted by another user in a shared directory, pointing into our own files
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, other, other)
    with pytest.raises(ConfigError, match=f"{link} is a symlink owned by uid {other}"):
        LocalCheckpointManager(link)


def test_a_file_as_root_names_the_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"{root} exists and is not a directory"):
        LocalCheckpointManager(root)
    with pytest.raises(ConfigError, match=f"{root}"):  # a file in the way of a parent
        LocalCheckpointManager(root / "sub")


def _find_latest_within(mgr: LocalCheckpointManager, seconds: float) -> int | None:
    found: list[int | None] = []
    thread = threading.Thread(target=lambda: found.append(mgr.find_latest()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"find_latest still blocked after {seconds} s"
    return found[0]


def test_the_scan_counts_regular_files_only_and_never_blocks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=3, timeout=60) as mgr:
        _save_durably(mgr, 3, 4)
        # iteration 4's part becomes a symlink to the same bytes outside the root
        (part,) = (root / "iter_000000000004").iterdir()
        outside = tmp_path / "outside.safetensors"
        shutil.move(part, outside)
        part.symlink_to(outside)
        # a FIFO named like a part of a newer iteration (opening it to read would block)
        (root / "iter_000000000005").mkdir(mode=0o700)
        fifo = root / "iter_000000000005" / "owner00000.h00000.safetensors"
        os.mkfifo(fifo)
        try:
            assert _find_latest_within(mgr, 30) == 3
        finally:  # let a blocked reader (the code before this fix) go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        assert mgr.load(3)["it"] == 3
