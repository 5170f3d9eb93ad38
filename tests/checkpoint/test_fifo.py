"""A FIFO named like a checkpoint file (a part, the commit marker, DCP's ``.metadata``, a
checkpoint file under a root) never blocks a load: it is refused as not a regular file."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.checkpoint import AsyncCheckpointer, latest, load
from trainguard.errors import CheckpointCorruptError

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


@contextlib.contextmanager
def _fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path`` (whatever was there goes); afterwards a reader blocked on it (the
    code before the fix) is let go: a writer opens it and closes it."""
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a thread: its result or its exception, or a failure if it still runs after
    ``seconds`` (a blocked open)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value


def _saved(root: Path) -> Path:
    """A committed two-part directory ``root/a`` (each part saved alone, then moved in)."""
    directory = root / "a"
    directory.mkdir()
    with AsyncCheckpointer() as ckpt:
        for rank in (0, 1):
            ckpt.save({"w": torch.full((4,), float(rank))}, root / f"p{rank}")
            ckpt.wait()
            (root / f"p{rank}").rename(directory / f"rank{rank:05d}.safetensors")
    (directory / "COMMITTED").write_text(json.dumps({"world_size": 2}))
    return directory


def test_a_fifo_part_or_marker_is_refused(tmp_path: Path) -> None:
    directory = _saved(tmp_path)
    with _fifo(directory / "rank00001.safetensors"):
        with pytest.raises(CheckpointCorruptError, match="is a FIFO, not a regular file"):
            _within(20, lambda: load(directory, rank=1))
        assert float(_within(20, lambda: load(directory, rank=0))["w"][0]) == 0.0
        with pytest.raises(CheckpointCorruptError, match="FIFO"):
            _within(20, lambda: load(directory, into={"w": torch.zeros(4)}, rank=1))
    with _fifo(directory / "COMMITTED"), pytest.raises(CheckpointCorruptError, match="FIFO"):
        _within(20, lambda: load(directory, rank=0))


def test_latest_skips_a_fifo_named_like_a_checkpoint_file(tmp_path: Path) -> None:
    directory = _saved(tmp_path)
    with _fifo(tmp_path / "b.safetensors"), _fifo(tmp_path / "c.pt"):
        assert _within(20, lambda: latest(tmp_path)) == directory


def test_a_fifo_metadata_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint.dcp import StorageReader, StorageWriter

    with StorageWriter(tmp_path / "d") as writer:
        dcp.save({"w": torch.ones(3)}, storage_writer=writer)
    with _fifo(tmp_path / "d" / ".metadata"), pytest.raises(CheckpointCorruptError, match="FIFO"):
        _within(20, lambda: StorageReader(tmp_path / "d").read_metadata())
