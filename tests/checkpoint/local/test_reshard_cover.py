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
