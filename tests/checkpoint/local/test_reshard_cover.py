"""``LocalCheckpointManager.load(it, into=)`` checks that the saved chunks cover each target
exactly once before it copies anything: overlapping chunks (which a count of copied elements
takes for a full cover) and holes are CheckpointCorruptError naming the region."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._craft import rewrite, with_skeleton
from trainguard.checkpoint import LocalCheckpointManager
from trainguard.errors import CheckpointCorruptError


def _two_owners(root: Path, rows: int, starts: tuple[int, int]) -> None:
    """Iteration 1 saved as if by two ranks, each holding 2 rows of a ``rows`` x 4 ``w``
    (owner 0 from row ``starts[0]``, filled with 1; owner 1 from row ``starts[1]``, filled
    with 2), both parts on this one rank's root."""
    with LocalCheckpointManager(root, keep=2) as mgr:
        mgr.save({"a": torch.full((2, 4), 1.0), "b": torch.full((2, 4), 2.0)}, 1)
        mgr.wait()
    directory = root / f"iter_{1:012d}"
    (part,) = directory.iterdir()
    blob = part.read_bytes()
    for owner, entry in enumerate(("a", "b")):
        node = {
            "S": entry,
            "dtype": "float32",
            "shape": [rows, 4],
            "offsets": [starts[owner], 0],
            "sizes": [2, 4],
            "mesh": [2],
            "placements": ["S0"],
        }

        def change(header: dict[str, Any], owner: int = owner, node: Any = node) -> Any:
            header["__metadata__"].update(owner=str(owner), world_size="2")
            return with_skeleton(header, {"D": [["w", node]]})

        path = directory / f"owner{owner:05d}.h00000.safetensors"
        path.write_bytes(rewrite(blob, change))
        path.chmod(0o600)


def _load(root: Path, target: torch.Tensor) -> None:
    with LocalCheckpointManager(root, keep=2) as mgr:
        mgr.load(1, into={"w": target})


def test_an_exact_cover_loads(tmp_path: Path) -> None:
    _two_owners(tmp_path, 4, (0, 2))
    target = torch.zeros(4, 4)
    _load(tmp_path, target)
    assert bool(target[:2].eq(1.0).all() and target[2:].eq(2.0).all())


def test_overlapping_chunks_are_not_a_full_cover(tmp_path: Path) -> None:
    _two_owners(tmp_path, 4, (0, 1))  # rows 0-1 and 1-2: row 1 twice, row 3 never
    target = torch.full((4, 4), -1.0)
    with pytest.raises(CheckpointCorruptError, match=r"overlap at offsets \(1, 0\) sizes \(1, 4\)"):
        _load(tmp_path, target)
    assert bool(target.eq(-1.0).all())  # refused before anything was copied


def test_a_hole_is_named(tmp_path: Path) -> None:
    _two_owners(tmp_path, 5, (0, 3))  # rows 0-1 and 3-4: row 2 never
    target = torch.full((5, 4), -1.0)
    with pytest.raises(
        CheckpointCorruptError, match=r"no chunk holds offsets \(2, 0\) sizes \(1, 4\)"
    ):
        _load(tmp_path, target)
    assert bool(target.eq(-1.0).all())


def _two_tensors(root: Path, w_rows: int, w_starts: tuple[int, int]) -> None:
    """Iteration 1 as if saved by two ranks, with two sharded tensors: ``v`` (4 x 4) covered
    exactly (rows 0-1 by owner 0, filled with 1; rows 2-3 by owner 1, filled with 2) and ``w``
    (``w_rows`` x 4) of 2 rows per owner from rows ``w_starts`` (filled with 3 and 4)."""
    with LocalCheckpointManager(root, keep=2) as mgr:
        state = {name: torch.full((2, 4), float(i + 1)) for i, name in enumerate("abcd")}
        mgr.save(state, 1)
        mgr.wait()
    directory = root / f"iter_{1:012d}"
    (part,) = directory.iterdir()
    blob = part.read_bytes()

    def node(entry: str, rows: int, start: int) -> dict[str, Any]:
        return {
            "S": entry,
            "dtype": "float32",
            "shape": [rows, 4],
            "offsets": [start, 0],
            "sizes": [2, 4],
            "mesh": [2],
            "placements": ["S0"],
        }

    for owner, (v, w) in enumerate((("a", "c"), ("b", "d"))):
        skeleton = {"D": [["v", node(v, 4, 2 * owner)], ["w", node(w, w_rows, w_starts[owner])]]}

        def change(header: dict[str, Any], owner: int = owner, skeleton: Any = skeleton) -> Any:
            header["__metadata__"].update(owner=str(owner), world_size="2")
            return with_skeleton(header, skeleton)

        path = directory / f"owner{owner:05d}.h00000.safetensors"
        path.write_bytes(rewrite(blob, change))
        path.chmod(0o600)


def test_a_bad_cover_of_a_later_tensor_changes_no_earlier_one(tmp_path: Path) -> None:
    """The whole checkpoint's cover is checked before the first tensor is filled: ``v`` (sound)
    comes first in the state, ``w`` (its chunks overlap) second, and ``v`` stays untouched."""
    _two_tensors(tmp_path, 4, (0, 1))
    target = {"v": torch.full((4, 4), -1.0), "w": torch.full((4, 4), -1.0)}
    with (
        LocalCheckpointManager(tmp_path, keep=2) as mgr,
        pytest.raises(CheckpointCorruptError, match=r"do not cover every sharded tensor"),
    ):
        mgr.load(1, into=target)
    assert bool(target["v"].eq(-1.0).all()), "v was filled before the bad cover was refused"
    assert bool(target["w"].eq(-1.0).all())


def test_a_hole_the_target_does_not_need_is_refused(tmp_path: Path) -> None:
    """Like the disk path, a hole is refused even where the target does not overlap it (a
    target holding only ``v`` of a checkpoint whose ``w`` misses row 2)."""
    _two_tensors(tmp_path, 5, (0, 3))
    target = {"v": torch.full((4, 4), -1.0)}
    with (
        LocalCheckpointManager(tmp_path, keep=2) as mgr,
        pytest.raises(CheckpointCorruptError, match=r"no chunk holds offsets \(2, 0\)"),
    ):
        mgr.load(1, into=target)
    assert bool(target["v"].eq(-1.0).all())
