"""trainguard.checkpoint.dcp.StorageReader on checkpoint directories nobody vouches for: a
planted ``.metadata`` never runs code, non-tensor values are never unpickled without
``allow_pickle=True``, a part's skeleton is checked like ``load`` checks it, and a FIFO named
like a file never blocks the load."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.checkpoint._craft import rewrite, with_skeleton
from trainguard.checkpoint.dcp import StorageReader, StorageWriter, _metadata
from trainguard.errors import CheckpointCorruptError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "h": torch.randn(3, generator=g).half(),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "m": torch.zeros(2, dtype=torch.bool),
        "i": torch.arange(7),
        "empty": torch.empty(0, 3),
        "meta": {"step": 12, "name": "run", "lr": [0.1, 0.2]},
    }


def _save(path: Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
    state = _state() if state is None else state
    with StorageWriter(path) as writer:
        dcp.save(state, storage_writer=writer)
    return state


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + struct.pack("<B", len(raw)) + raw


def _call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (resolved as a dotted path) on
    ``arg``."""
    return b"\x80\x04" + _unicode(module) + _unicode(name) + b"\x93" + _unicode(arg) + b"\x85R."


class _Recorder(pickle.Unpickler):
    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_the_allowed_globals_are_what_real_metadata_holds(tmp_path: Path) -> None:
    _save(tmp_path / "a")
    with open(tmp_path / "a" / _metadata.NAME, "rb") as f:
        recorder = _Recorder(f)
        recorder.load()
    assert recorder.seen <= _metadata.ALLOWED
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in recorder.seen
    assert StorageReader(tmp_path / "a").read_metadata().state_dict_metadata.keys() >= {"w", "i"}


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),  # a dotted protocol-4 name
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__.get"),
        ("torch", "serialization.os.system"),
        ("builtins", "eval"),
        ("os", "system"),
    ],
)
def test_a_planted_metadata_runs_no_code(module: str, name: str, tmp_path: Path) -> None:
    _save(tmp_path / "a")
    ran = tmp_path / "ran"
    command = f"touch {ran}"
    (tmp_path / "a" / _metadata.NAME).write_bytes(_call(module, name, command))
    with pytest.raises(CheckpointCorruptError) as info:
        StorageReader(tmp_path / "a").read_metadata()
    assert not ran.exists(), "the planted metadata ran a command"
    assert "unreadable DCP metadata" in str(info.value) and "refers to" in str(info.value)
    with pytest.raises(CheckpointException, match="unreadable DCP metadata"):
        dcp.load({"w": torch.zeros(6, 5)}, storage_reader=StorageReader(tmp_path / "a"))
    assert not ran.exists()


class _Runs:
    """A value whose pickle runs ``touch path`` when it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@dataclasses.dataclass
class _Point:
    x: int
    y: int


def test_non_tensor_values_are_never_unpickled_without_allow_pickle(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    _save(tmp_path / "a", {"w": torch.ones(3), "evil": _Runs(ran), "step": 7})
    target: dict[str, Any] = {"w": torch.zeros(3), "evil": None, "step": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    assert not ran.exists(), "loading the checkpoint ran a command"
    text = str(info.value)
    assert "CheckpointPickleError" in text and "allow_pickle=True" in text
    assert "entry 'evil'" in text and "posix.system" in text
    # what weights_only reads loads as before; the switch hands the planner the saved bytes
    target = {"w": torch.zeros(3), "step": 0}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    assert target["step"] == 7 and torch.equal(target["w"], torch.ones(3))
    target = {"w": torch.zeros(3), "evil": None, "step": 0}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "a", allow_pickle=True))
    assert ran.exists()


def test_values_of_safe_globals_load_without_allow_pickle(tmp_path: Path) -> None:
    state = _save(tmp_path / "a", {"p": _Point(1, 2), "meta": {"lr": [0.1, 0.2], "n": "x"}})
    target: dict[str, Any] = {"p": None, "meta": {"lr": None, "n": None}}
    with pytest.raises(CheckpointException, match="add_safe_globals"):
        dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    with torch.serialization.safe_globals([_Point]):
        dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    assert target == state


def _part(directory: Path) -> Path:
    return directory / "rank00000.safetensors"


def _edit_skeleton(directory: Path, change: Any, *, checksum: bool = True) -> None:
    """Rewrite the part's skeleton nodes (``change(nodes)`` edits ``{entry: node}`` in
    place); with ``checksum``, the skeleton's checksum is made to match."""

    def edit(header: dict[str, Any]) -> dict[str, Any]:
        tree = json.loads(header["__metadata__"]["skeleton"])
        nodes = dict(tree["D"])
        change(nodes)
        tree = {"D": [[k, v] for k, v in nodes.items()]}
        if checksum:
            return with_skeleton(header, tree)
        header["__metadata__"]["skeleton"] = json.dumps(tree)
        return header

    path = _part(directory)
    path.write_bytes(rewrite(path.read_bytes(), edit))


def _edit_metadata(directory: Path, name: str, size: tuple[int, ...]) -> None:
    """DCP's metadata claims ``name`` (one chunk at the origin) has shape ``size``."""
    metadata = _metadata.read(str(directory))
    md = metadata.state_dict_metadata[name]
    md.size = torch.Size(size)
    md.chunks[0].sizes = torch.Size(size)
    os.unlink(directory / _metadata.NAME)
    _metadata.write(str(directory), metadata)


def _load_error(directory: Path, target: dict[str, Any]) -> str:
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=StorageReader(directory))
    return str(info.value)


def test_the_skeleton_checksum_is_checked(tmp_path: Path) -> None:
    _save(tmp_path / "a")

    def as_int(nodes: dict[str, Any]) -> None:  # same item size: the bytes would still fit
        nodes["w@0,0"]["dtype"] = "int32"

    _edit_skeleton(tmp_path / "a", as_int, checksum=False)
    text = _load_error(tmp_path / "a", {"w": torch.zeros(6, 5)})
    assert "CheckpointCorruptError" in text and "checksum mismatch in the skeleton" in text


def test_an_empty_entry_never_becomes_an_uninitialised_tensor(tmp_path: Path) -> None:
    _save(tmp_path / "a")

    def grow(nodes: dict[str, Any]) -> None:
        nodes["empty@0,0"]["shape"] = [4096, 3]

    _edit_skeleton(tmp_path / "a", grow)
    _edit_metadata(tmp_path / "a", "empty", (4096, 3))
    target = {"empty": torch.full((4096, 3), 7.0)}
    text = _load_error(tmp_path / "a", target)
    assert "CheckpointCorruptError" in text and "entry 'empty@0,0'" in text
    assert "needs 49152 bytes, its entry holds 0" in text
    assert bool((target["empty"] == 7.0).all())


def test_chunk_offsets_outside_the_saved_chunk_are_corrupt(tmp_path: Path) -> None:
    _save(tmp_path / "a")
    _edit_metadata(tmp_path / "a", "w", (12, 5))  # the saved chunk holds 6 x 5
    text = _load_error(tmp_path / "a", {"w": torch.zeros(12, 5)})
    assert "CheckpointCorruptError" in text and "RuntimeError" not in text
    assert "lengths [12, 5] of a saved chunk of shape [6, 5]" in text
