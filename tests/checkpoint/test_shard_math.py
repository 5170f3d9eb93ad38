"""Box math of sharded tensors, the fileformat's range reads, and the index of saved chunks
(single process; the multi-rank tests are in test_sharded.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.checkpoint._shards import Box, copy_overlap, dtensor_box, local_view
from trainguard.checkpoint.fileformat import (
    header_bytes,
    parse_header_bytes,
    read_header,
    read_range,
)
from trainguard.checkpoint.layout import flatten
from trainguard.errors import CheckpointCorruptError


def test_box_intersect() -> None:
    a = Box((0, 0), (4, 6))
    assert a.intersect(Box((3, 2), (4, 6))) == Box((3, 2), (1, 4))
    assert a.intersect(Box((4, 0), (3, 6))) is None  # touching edges share nothing
    assert a.intersect(Box((1, 1), (0, 3))) is None  # an empty box shares nothing
    assert Box((2,), (5,)).intersect(Box((0,), (10,))) == Box((2,), (5,))
    assert Box((), ()).intersect(Box((), ())) == Box((), ())  # a 0-d tensor: one element
    assert Box((), ()).numel == 1 and Box((1, 2), (3, 0)).numel == 0
    with pytest.raises(ValueError):
        Box((0,), (1,)).intersect(Box((0, 0), (1, 1)))


def test_copy_overlap_uneven_1d() -> None:
    full = torch.arange(7.0)
    saved = [(Box((o,), (n,)), full[o : o + n].clone()) for o, n in ((0, 3), (3, 3), (6, 1))]
    for offset, size in ((0, 2), (2, 2), (4, 2), (6, 1)):  # 7 rows over 4 ranks
        box = Box((offset,), (size,))
        dst = torch.zeros(size)
        copied = sum(copy_overlap(t, b, dst, box) for b, t in saved)
        assert copied == size and torch.equal(dst, full[offset : offset + size])


def test_copy_overlap_2d() -> None:
    full = torch.arange(42.0).reshape(7, 6)
    src_box = Box((4, 3), (3, 3))
    src = full[4:7, 3:6].clone()
    dst_box = Box((3, 2), (3, 2))
    dst = torch.zeros(3, 2)
    assert copy_overlap(src, src_box, dst, dst_box) == 2 * 1  # rows 4..5, column 3
    assert torch.equal(dst[1:3, 1], full[4:6, 3]) and dst[0].eq(0).all() and dst[:, 0].eq(0).all()
    assert copy_overlap(src, src_box, torch.zeros(2, 2), Box((0, 0), (2, 2))) == 0


def test_plain_tensor_box_and_view() -> None:
    t = torch.zeros(3, 4)
    assert dtensor_box(t) == Box((0, 0), (3, 4))
    assert local_view(t) is t
    assert dtensor_box(torch.tensor(1.0)) == Box((), ())


def _write(path: Path, state: object) -> None:
    from trainguard.checkpoint import AsyncCheckpointer

    with AsyncCheckpointer() as ckpt:
        ckpt.save(state, path)
        ckpt.wait()


def test_read_range_and_header_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    w = torch.arange(10, dtype=torch.float32)
    _write(path, {"w": w})
    header = read_header(path)
    raw = header_bytes(path)
    assert len(raw) == header.data_start
    again = parse_header_bytes(raw, "peer's a", header.file_size)
    assert again.entries == header.entries and again.path == "peer's a"
    _, _, begin, end = header.entries["w"]
    data = read_range(path, header.data_start + begin, header.data_start + end)
    assert torch.equal(torch.frombuffer(data, dtype=torch.float32), w)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        read_range(path, header.file_size - 4, header.file_size + 4)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        parse_header_bytes(raw[:100], "cut", header.file_size)


def test_flatten_plain_state_has_no_shards() -> None:
    assert not flatten({"w": torch.zeros(2)}).sharded
