"""save() refuses, in the caller's thread, a state a reader would refuse: a header over the
reader's limit (naming the leaf) and containers nested deeper than the format allows."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._craft import nested
from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager, load
from trainguard.checkpoint.format.kinds import MAX_DEPTH
from trainguard.errors import CheckpointError

# 16 Mi control characters: JSON writes each as \u0001 in the skeleton, which the header writes
# again escaped: about 112 MB of header, more than the 100 MiB a reader accepts.
_HUGE_LEAF = "\x01" * (16 << 20)


def _deep(depth: int) -> Any:
    return {"model": {"w": torch.ones(2)}, "loader": nested(depth)}


def test_async_save_refuses_a_header_a_reader_would_refuse(tmp_path: Path) -> None:
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(CheckpointError, match=r"state\['loader'\]\['log'\]") as info:
            ckpt.save({"w": torch.ones(3), "loader": {"log": _HUGE_LEAF}}, tmp_path / "a")
        assert "reader accepts" in str(info.value) and "as tensors" in str(info.value)
        assert not (tmp_path / "a").exists()
        ckpt.save({"w": torch.ones(3)}, tmp_path / "b")  # the checkpointer goes on
        ckpt.wait()
    assert torch.equal(load(tmp_path / "b")["w"], torch.ones(3))


def test_local_save_refuses_a_header_a_reader_would_refuse(tmp_path: Path) -> None:
    with (
        LocalCheckpointManager(tmp_path / "root", timeout=timedelta(seconds=60)) as mgr,
        pytest.raises(CheckpointError, match=r"state\['log'\]"),
    ):
        mgr.save({"w": torch.ones(3), "log": _HUGE_LEAF}, 1)


def test_deeply_nested_state_is_refused_by_save(tmp_path: Path) -> None:
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(CheckpointError, match=f"more than {MAX_DEPTH} levels"):
            ckpt.save(_deep(5000), tmp_path / "deep")
        loop: list[Any] = []
        loop.append(loop)
        with pytest.raises(CheckpointError, match="holds itself"):
            ckpt.save({"loop": loop}, tmp_path / "loop")
        ckpt.save(_deep(MAX_DEPTH - 1), tmp_path / "ok")  # the leaf at the limit: round-trips
        ckpt.wait()
    back = load(tmp_path / "ok")["loader"]
    for _ in range(MAX_DEPTH - 1):
        back = back[0]
    assert back == 1
