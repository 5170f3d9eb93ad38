"""A planted DCP ``.metadata`` whose pickle sets attributes (``BUILD``) on an object of the
process, an allowed class, function or enum member, is refused and changes nothing: a good
checkpoint loaded after it in the same process loads as saved."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    Metadata,
    TensorStorageMetadata,
)

from trainguard.checkpoint.dcp import StorageReader, StorageWriter, _metadata
from trainguard.errors import CheckpointCorruptError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_DCP = "torch.distributed.checkpoint.metadata"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _dict(items: dict[str, bytes]) -> bytes:
    """A pickled dict of ``{key: the pickle of its value}``."""
    return b"}" + b"".join(_text(k) + v + b"s" for k, v in items.items())


# The planted files: protocol 2, BUILD with a state on an object every load in the process
# shares, then that object as the result (not Metadata, so that the file is refused after the
# BUILD ran, on a reader that allows it).
_PLANTED = {
    # _get_layout's cache: every later layout named "torch.strided" would be a dtype
    "function": _global("torch.serialization", "_get_layout")
    + _dict({"cache": _dict({"torch.strided": _global("torch", "float32")})})
    + b"b.",
    # an attribute of the class (slot state: setattr): a later Metadata's BUILD calls it
    "class": _global(_DCP, "Metadata")
    + b"N"
    + _dict({"__setstate__": _global("torch", "Size")})
    + b"\x86b.",
    # an attribute of an enum member (a singleton of the process)
    "enum member": _global(_DCP, "_MEM_FORMAT_ENCODING")
    + b"K\x00\x85R"
    + _dict({"planted": b"K\x01"})
    + b"b.",
}


def _shared() -> list[Any]:
    """The objects the planted files aim at."""
    return [torch.serialization._get_layout, Metadata, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT]


def _attributes() -> list[dict[str, Any]]:
    return [dict(vars(obj)) for obj in _shared()]


@pytest.fixture()
def restored() -> Iterator[None]:
    """The shared objects get their attributes back after the test: a failure here never
    poisons the tests that run next in this process."""
    before = _attributes()
    yield
    for obj, attrs in zip(_shared(), before, strict=True):
        for name in set(vars(obj)) - set(attrs):
            delattr(obj, name)
        for name, value in attrs.items():
            if vars(obj).get(name, object()) is not value:
                setattr(obj, name, value)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "i": torch.arange(7), "step": 12}


@pytest.mark.parametrize("aim", sorted(_PLANTED))
def test_a_refused_metadata_sets_nothing_on_the_objects_of_the_process(
    aim: str, tmp_path: Path, restored: None
) -> None:
    state = _state()
    for name in ("good", "planted"):
        with StorageWriter(tmp_path / name) as writer:
            dcp.save(state, storage_writer=writer)
    untouched = _attributes()  # after the saves (pickling a class caches its __slotnames__)
    (tmp_path / "planted" / _metadata.NAME).write_bytes(_PLANTED[aim])
    with pytest.raises(CheckpointCorruptError) as info:
        StorageReader(tmp_path / "planted").read_metadata()

    assert _attributes() == untouched, "the refused file changed them"
    metadata = StorageReader(tmp_path / "good").read_metadata()
    assert isinstance(metadata, Metadata)
    entry = metadata.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata) and entry.properties.layout is torch.strided
    target: dict[str, Any] = {
        "w": torch.zeros(6, 5),
        "i": torch.zeros(7, dtype=torch.long),
        "step": 0,
    }
    dcp.load(target, storage_reader=StorageReader(tmp_path / "good"))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["i"], state["i"])
    assert target["step"] == 12
    text = str(info.value)
    assert "unreadable DCP metadata" in text and "sets the state of" in text, text


def test_real_metadata_still_reads_with_every_build_it_holds(tmp_path: Path) -> None:
    """Every BUILD of a real file is on a fresh metadata object: the narrowed reader gives
    the same metadata as pickle's own."""
    import pickle
    import pickletools

    with StorageWriter(tmp_path / "a") as writer:
        dcp.save(
            {**_state(), "h": torch.zeros(3).half(), "meta": {"lr": [0.1]}}, storage_writer=writer
        )
    raw = (tmp_path / "a" / _metadata.NAME).read_bytes()
    assert sum(op.name == "BUILD" for op, _, _ in pickletools.genops(raw)) >= 5
    assert _metadata.read(str(tmp_path / "a")) == pickle.loads(raw)
