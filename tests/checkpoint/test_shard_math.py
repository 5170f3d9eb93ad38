"""Box math of sharded tensors, the file format's range reads, and the index of saved chunks
(single process; the multi-rank tests are in test_sharded.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.read import (
    header_bytes,
    parse_header_bytes,
    read_header,
    read_range,
)
from trainguard.checkpoint.format.shards import Box, copy_overlap, dtensor_box, local_view
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


# ---------------------------------------------------------------- crafted sharded checkpoints


def _part(path: Path, skeleton: object, tensors: dict[str, torch.Tensor]) -> None:
    """Write one part with a hand-made skeleton (as a rank of a sharded save would)."""
    import json
    from types import SimpleNamespace

    from trainguard.checkpoint.format.kinds import SAFETENSORS_DTYPES
    from trainguard.checkpoint.format.write import place, write_file

    entries = [
        SimpleNamespace(
            name=name,
            dtype=SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")],
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
            align=t.element_size(),
        )
        for name, t in tensors.items()
    ]
    placed, nbytes = place(entries)
    data = bytearray(nbytes)
    for p in placed:
        raw = tensors[p.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        data[p.offset : p.offset + p.nbytes] = raw
    meta = {"skeleton": json.dumps(skeleton)}
    write_file(str(path), memoryview(data), placed, meta, fsync=False)


def _snode(entry: str | None, offsets: list[int], sizes: list[int]) -> dict[str, object]:
    return {
        "S": entry,
        "dtype": "float32",
        "shape": [4, 3],
        "offsets": offsets,
        "sizes": sizes,
        "mesh": [2],
        "placements": ["S0"],
    }


FULL = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def _sharded(tmp_path: Path, second: tuple[int, int]) -> Path:
    """Two parts of a (4, 3) tensor: rows 0..1 in part 0, rows ``second`` in part 1."""
    root = tmp_path / "ckpt"
    root.mkdir()
    lo, hi = second
    _part(
        root / "rank00000.safetensors",
        {"D": [["w", _snode("w", [0, 0], [2, 3])], ["n", 1], ["t", {"U": [2, "x"]}]]},
        {"w": FULL[:2]},
    )
    _part(
        root / "rank00001.safetensors",
        {"D": [["w", _snode("w", [lo, 0], [hi - lo, 3])], ["n", 2], ["t", {"U": [3, "y"]}]]},
        {"w": FULL[lo:hi]},
    )
    return root


def _index(root: Path):  # type: ignore[no-untyped-def]
    from trainguard.checkpoint._reshard import Index

    return Index.from_headers({r: read_header(root / f"rank{r:05d}.safetensors") for r in (0, 1)})


def test_sharded_parts_fill_a_plain_target(tmp_path: Path) -> None:
    from trainguard.checkpoint import load
    from trainguard.checkpoint._reshard import file_reader, fill
    from trainguard.checkpoint.format.read import check_file
    from trainguard.errors import CheckpointError

    root = _sharded(tmp_path, (2, 4))
    for r in (0, 1):
        check_file(root / f"rank{r:05d}.safetensors")  # the "S" nodes' fields pass
    index = _index(root)
    assert index.saved_world == 2 and index.coverage_problems() == []
    ((shape, dtype, chunks),) = index.tensors().values()
    assert shape == (4, 3) and dtype == torch.float32 and [c.part for c in chunks] == [0, 1]
    target = {"w": torch.empty(4, 3), "n": None, "t": (0, "")}
    back = load(root, into=target, rank=1, allow_uncommitted=True)
    assert back is target and torch.equal(target["w"], FULL)
    assert target["n"] == 2 and target["t"] == (3, "y")  # plain values: this rank's part
    assert load(root, into={"n": 0}, rank=5, allow_uncommitted=True) == {"n": 1}  # part 0
    paths = {r: str(root / f"rank{r:05d}.safetensors") for r in (0, 1)}
    stats = fill({"w": torch.empty(4, 3)}, index, file_reader(paths), plain_part=0)
    assert (stats.bytes_read, stats.chunks_read, stats.parts_read) == (48, 2, {0, 1})
    with pytest.raises(CheckpointError, match=r"into=target_state"):
        load(root, rank=0, allow_uncommitted=True)
    with pytest.raises(CheckpointError, match=r"state\['v'\] is not in the checkpoint"):
        load(root, into={"v": torch.empty(1)}, rank=0, allow_uncommitted=True)
    with pytest.raises(CheckpointError, match=r"state\['w'\].*\[4, 3\].*\[3, 4\]"):
        load(root, into={"w": torch.empty(3, 4)}, rank=0, allow_uncommitted=True)


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        (
            (1, 4),
            r"offsets \(0, 0\) \(part 0\) and \(1, 0\) \(part 1\) overlap at offsets \(1, 0\) sizes \(1, 3\)",
        ),
        ((3, 4), r"its chunks cover 9 of its 12 elements"),
    ],
)
def test_coverage_problems_overlap_and_gap(
    tmp_path: Path, second: tuple[int, int], problem: str
) -> None:
    import re

    from trainguard.checkpoint import load

    root = _sharded(tmp_path, second)
    (found,) = _index(root).coverage_problems()
    assert found.startswith("state['w']: ") and re.search(problem, found), found
    with pytest.raises(CheckpointCorruptError, match=problem):
        load(root, into={"w": torch.empty(4, 3)}, rank=0, allow_uncommitted=True)


def test_corrupt_chunk_and_malformed_node(tmp_path: Path) -> None:
    from trainguard.checkpoint import load
    from trainguard.checkpoint.format.read import check_file

    root = _sharded(tmp_path, (2, 4))
    part = root / "rank00001.safetensors"
    header = read_header(part)
    with open(part, "r+b") as f:
        f.seek(header.data_start + header.entries["w"][2] + 5)
        f.write(b"\xff")
    with pytest.raises(
        CheckpointCorruptError,
        match=r"rank00001.safetensors: checksum mismatch in chunk of state\['w'\] at offsets "
        r"\(2, 0\) sizes \(2, 3\)",
    ):
        load(root, into={"w": torch.empty(4, 3)}, rank=0, allow_uncommitted=True)
    bad = tmp_path / "bad.safetensors"
    _part(bad, {"D": [["w", _snode("w", [3, 0], [2, 3])]]}, {"w": FULL[:2]})
    with pytest.raises(CheckpointCorruptError, match=r"state\['w'\].*outside its shape"):
        check_file(bad)


def test_plain_views_load_into_and_read_their_entry_once(tmp_path: Path) -> None:
    from trainguard.checkpoint._reshard import Index, file_reader, fill

    base = torch.arange(12.0).reshape(3, 4)
    path = tmp_path / "views.safetensors"
    _write(path, {"w": base, "t": base.t(), "k": (1, 2)})
    target = {"w": torch.empty(3, 4), "t": torch.empty(4, 3), "k": (0, 0)}
    stats = fill(
        target,
        Index.from_headers({0: read_header(path)}),
        file_reader({0: str(path)}),
        plain_part=0,
    )
    assert torch.equal(target["w"], base) and torch.equal(target["t"], base.t())
    assert target["k"] == (1, 2)
    assert (stats.chunks_read, stats.bytes_read) == (1, 48)  # one shared entry, read once
