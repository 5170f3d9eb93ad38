"""Crafted and damaged checkpoint files: every one raises CheckpointCorruptError naming what is
wrong, allocates nothing the file does not hold, and `ckpt verify` judges like `load` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._craft import (
    deep_json,
    file_bytes,
    join,
    nested,
    rewrite,
    split,
    with_skeleton,
)
from trainguard.checkpoint import load
from trainguard.checkpoint.format.read import load_buffer, read_header
from trainguard.errors import CheckpointCorruptError, CheckpointError

_GiB = 1 << 30


def _base() -> bytes:
    return file_bytes({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 7})


def _corrupt(blob: bytes, tmp_path: Path, match: str) -> None:
    """``blob`` is refused with CheckpointCorruptError matching ``match``, from a file (through
    the public ``load``) and from memory."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointCorruptError, match=match):
        load(path)
    with pytest.raises(CheckpointCorruptError, match=match):
        load_buffer(bytearray(blob), "copy")


def _entry(header: dict[str, Any]) -> dict[str, Any]:
    return header["w"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda h: _entry(h).update(data_offsets=[0, 1e999]), "data_offsets"),
        (lambda h: _entry(h).update(data_offsets=[-8, 16]), "data_offsets"),
        (lambda h: _entry(h).update(data_offsets=[0.0, 24.0]), "data_offsets"),
        (lambda h: _entry(h).update(data_offsets=[0, 1 << 40]), "data_offsets"),
        (lambda h: _entry(h).update(data_offsets=[0]), "data_offsets"),
        (lambda h: _entry(h).update(shape="2x3"), "shape"),
        (lambda h: _entry(h).update(shape=[2, True]), "shape"),
        (lambda h: _entry(h).update(shape=[2, 4]), "needs 32 bytes"),
        (lambda h: _entry(h).update(dtype="F128"), "dtype"),
        (lambda h: _entry(h).update(dtype=["F32"]), "dtype"),
        (lambda h: h.update(w=[1, 2]), "entry 'w'"),
        (lambda h: h.update(__metadata__=["format", "trainguard"]), "__metadata__"),
        (lambda h: h["__metadata__"].update(rank=0), "__metadata__"),
        (lambda h: h["__metadata__"].update(checksums="[1, 2]"), "checksums"),
        (lambda h: h["__metadata__"].update(checksums='{"w": 5}'), "checksums"),
        (lambda h: h["__metadata__"].update(checksums="{"), "checksums"),
        (lambda h: h["__metadata__"].update(checksums="{}"), "no checksum"),
        (lambda h: h["__metadata__"].update(format_version="9"), "format_version"),
        (lambda h: h["__metadata__"].update(skeleton_checksum="0" * 16), "skeleton"),
        (lambda h: h.update(v={"dtype": "U8", "shape": [8], "data_offsets": [16, 24]}), "overlap"),
        (lambda h: [1, 2, 3], "not a JSON object"),
    ],
)
def test_malformed_header_fields_are_named(change: Any, match: str, tmp_path: Path) -> None:
    _corrupt(rewrite(_base(), change), tmp_path, match)


def test_deep_nesting_and_huge_numbers_in_the_header(tmp_path: Path) -> None:
    header, data = split(_base())
    deep = deep_json(100_000).encode()
    _corrupt(join(None, data, body=deep), tmp_path, "nests too deeply")
    entry = json.dumps(header["w"]).encode()
    _corrupt(join(None, data, body=b'{"w": ' + entry + b', "x": ' + deep + b"}"),
             tmp_path, "nests too deeply")  # fmt: skip
    _corrupt(join(None, data, body=b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b"]}}"),
             tmp_path, "not valid JSON")  # fmt: skip
    _corrupt(join(None, data, body=b"\xff\xfe{}"), tmp_path, "not valid JSON")


def _skeleton_case(skeleton: Any) -> bytes:
    return rewrite(_base(), lambda h: with_skeleton(h, skeleton))


_T = {"T": "w", "dtype": "float32", "shape": [2, 3]}


@pytest.mark.parametrize(
    ("skeleton", "match"),
    [
        (deep_json(100_000), "nests too deeply"),  # json.loads' own recursion
        ({"L": [nested(500, {"L": []})]}, "malformed skeleton"),  # raw lists are not nodes
        ({"D": [["w", {"T": "nope", "dtype": "float32", "shape": [6]}]]}, "missing"),
        ({"D": [["w", {**_T, "dtype": "nn"}]]}, "unknown dtype 'nn'"),
        ({"D": [["w", {**_T, "dtype": "testing"}]]}, "unknown dtype"),
        ({"D": [["w", {**_T, "shape": [4, 3]}]]}, "needs 48 bytes"),
        ({"D": [["w", {**_T, "shape": [3]}]]}, "needs 12 bytes"),
        ({"D": [["w", {**_T, "shape": [1 << 29, 1]}]]}, "needs"),  # 2 GiB from 24 bytes
        ({"D": [["w", {**_T, "shape": [1 << 40, 1], "stride": [0, 0], "offset": 0}]]}, "needs"),
        ({"D": [["w", {**_T, "shape": [3], "stride": [1], "offset": 4}]]}, "past its entry"),
        ({"D": [["w", {**_T, "shape": [3], "stride": [-1], "offset": 2}]]}, "stride"),
        ({"D": [["w", {**_T, "shape": [2, 3], "stride": [3, 1], "offset": 1e999}]]}, "offset"),
        ({"D": [["w", {**_T, "shape": "6"}]]}, "shape"),
        ({"D": [["w", {**_T, "bogus": 1}]]}, "unexpected fields"),
        ({"D": {"w": 1}}, "pairs"),
        ({"D": [[["k"], 1]]}, "pairs"),
        ({"F": "1e999"}, "'F' node"),
        ({"B": "!!!"}, "base64"),
        ({"size": [-1]}, "'size' node"),
        ({"device": "warp:9"}, "device"),
        ({"Q": 1}, "'Q' node"),
        ({"L": [], "U": []}, "several tags"),
        ([1, 2], "list where a tagged node"),
    ],
)
def test_malformed_skeletons_are_named(skeleton: Any, match: str, tmp_path: Path) -> None:
    _corrupt(_skeleton_case(skeleton), tmp_path, match)


def test_an_empty_entry_never_becomes_a_large_tensor(tmp_path: Path) -> None:
    """A 4 KiB file used to load as a 2 GiB ``torch.empty``: the shape of an empty entry."""

    def change(h: dict[str, Any]) -> dict[str, Any]:
        h["e"] = {"dtype": "F32", "shape": [0], "data_offsets": [24, 24]}
        h["__metadata__"]["checksums"] = json.dumps(
            {**json.loads(h["__metadata__"]["checksums"]), "e": "2d06800538d394c2"}
        )
        e = {"T": "e", "dtype": "float32", "shape": [_GiB // 2]}
        return with_skeleton(h, {"D": [["e", e]]})

    _corrupt(rewrite(_base(), change), tmp_path, "needs 2147483648 bytes")


def test_unknown_dtype_imports_nothing() -> None:
    code = (
        "import json, sys, torch\n"
        "from tests.checkpoint._craft import file_bytes, rewrite, with_skeleton\n"
        "from trainguard.checkpoint.format.read import load_buffer\n"
        "from trainguard.errors import CheckpointCorruptError\n"
        "sys.modules.pop('torch.onnx', None)\n"
        "t = {'T': 'w', 'dtype': 'onnx', 'shape': [1]}\n"
        "blob = rewrite(file_bytes({'w': torch.ones(1)}), "
        "lambda h: with_skeleton(h, {'D': [['w', t]]}))\n"
        "try:\n    load_buffer(bytearray(blob), 'x')\nexcept CheckpointCorruptError:\n    pass\n"
        "print('torch.onnx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_valid_files_still_load(tmp_path: Path) -> None:
    """The checks refuse nothing ``save`` writes: nesting up to the limit, views, empties."""
    base = torch.arange(12, dtype=torch.float32)
    state = {
        "deep": nested(99, torch.ones(2)),
        "views": [base, base.view(3, 4).t(), base[2:5]],
        "empty": torch.empty(0, 3),
        "misc": (b"\x00\x01", float("nan"), torch.Size([2]), torch.int8, None),
    }
    back, _ = load_buffer(bytearray(file_bytes(state)), "mem")
    assert torch.equal(back["views"][1], state["views"][1])
    assert back["views"][1].untyped_storage().data_ptr() == back["views"][0].data_ptr()
    inner = back["deep"]
    for _ in range(99):
        inner = inner[0]
    assert torch.equal(inner, torch.ones(2))


def test_expanded_views_are_stored_whole() -> None:
    """A view that spans more elements than its storage (expand) is written by itself, so the
    reader's rule (no view larger than its entry) never refuses what save wrote."""
    one = torch.ones(1)
    state = {"one": one, "wide": one.expand(1000)}
    back, header = load_buffer(bytearray(file_bytes(state)), "mem")
    assert torch.equal(back["wide"], state["wide"])
    assert sum(e - b for _, _, b, e in header.entries.values()) == 4 + 4000


def test_header_of_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_base())
    header = read_header(path)
    assert header.metadata["format_version"] == "2"
    assert set(header.checksums()) == {"w"}


def test_truncated_marker_is_corrupt(tmp_path: Path) -> None:
    directory = tmp_path / "multi"
    directory.mkdir()
    (directory / "rank00000.safetensors").write_bytes(_base())
    for text in ("[1]", '{"world_size": "x"}', "{"):
        (directory / "COMMITTED").write_text(text)
        with pytest.raises(CheckpointCorruptError, match="commit marker"):
            load(directory, rank=0)


def test_damaged_torch_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(3)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointCorruptError, match=r"torch\.load failed"):
        load(path)


def test_corrupt_is_a_checkpoint_error() -> None:
    assert issubclass(CheckpointCorruptError, CheckpointError)
