"""Every part of a multi-rank checkpoint and its commit marker carry the save's id: ``load``
refuses a part of another save put beside a marker, and loads checkpoints written before the
save id existed (a marker and parts without one) as before."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from tests.checkpoint._craft import rewrite
from trainguard.checkpoint import AsyncCheckpointer, load
from trainguard.checkpoint.format.read import read_header
from trainguard.errors import CheckpointCorruptError

_PART = "rank00000.safetensors"


@pytest.fixture
def store() -> Iterator[TCPStore]:
    s = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60))
    yield s
    del s


def _save(store: TCPStore, *paths_and_steps: tuple[Path, int]) -> None:
    with AsyncCheckpointer(store=store, rank=0, world_size=1, commit_timeout=60) as ckpt:
        for path, step in paths_and_steps:
            ckpt.save({"step": step, "w": torch.full((16,), float(step))}, path)
            ckpt.wait()


def _marker(path: Path) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((path / "COMMITTED").read_text())
    return info


def test_marker_and_parts_name_one_save(tmp_path: Path, store: TCPStore) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _save(store, (a, 1), (b, 2), (a, 3))  # the third overwrites a (a swap)
    ids = {p: _marker(p)["save_id"] for p in (a, b)}
    assert len(set(ids.values())) == 2 and all(len(i) == 16 for i in ids.values()), ids
    for p in (a, b):
        assert read_header(p / _PART).metadata["save_id"] == ids[p]
    assert load(a, rank=0)["step"] == 3


def test_a_part_of_another_save_is_refused(tmp_path: Path, store: TCPStore) -> None:
    """The part of save ``b`` copied over ``a``'s (same rank, same layout, a whole valid
    file): loading ``a`` is refused, whole or resharded, instead of returning ``b``'s state
    under ``a``'s marker."""
    a, b = tmp_path / "a", tmp_path / "b"
    _save(store, (a, 1), (b, 2))
    shutil.copyfile(b / _PART, a / _PART)
    with pytest.raises(CheckpointCorruptError, match="parts of two saves"):
        load(a, rank=0)
    into = {"step": -1, "w": torch.zeros(16)}
    with pytest.raises(CheckpointCorruptError, match="parts of two saves"):
        load(a, rank=0, into=into)
    assert into["step"] == -1 and bool(into["w"].eq(0).all())  # refused before any copy


def test_a_checkpoint_without_save_ids_still_loads(tmp_path: Path, store: TCPStore) -> None:
    """A checkpoint as trainguard wrote it before save ids: neither the marker nor the part
    holds one."""
    a = tmp_path / "a"
    _save(store, (a, 5))
    info = _marker(a)
    del info["save_id"]
    (a / "COMMITTED").write_text(json.dumps(info))

    def drop(header: dict[str, Any]) -> None:
        del header["__metadata__"]["save_id"]

    (a / _PART).write_bytes(rewrite((a / _PART).read_bytes(), drop))
    assert "save_id" not in read_header(a / _PART).metadata
    assert load(a, rank=0)["step"] == 5
    into = {"step": -1, "w": torch.zeros(16)}
    assert load(a, rank=0, into=into)["step"] == 5 and bool(into["w"].eq(5.0).all())
