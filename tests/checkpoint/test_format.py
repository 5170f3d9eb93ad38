"""File format and layout: bit-exact round trips, compatibility, corruption, pickle rules."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import assert_same, sample_state
from trainguard.checkpoint import AsyncCheckpointer, load
from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.read import read_header
from trainguard.checkpoint.format.write import ALIGN
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPickleError,
)


@pytest.fixture(scope="module")
def ckpt():
    with AsyncCheckpointer() as c:
        yield c


def _save(ckpt: AsyncCheckpointer, state, path: Path, **kw) -> Path:
    ckpt.save(state, path, **kw)
    ckpt.wait()
    return path


def test_round_trip_is_bit_exact(ckpt, tmp_path) -> None:
    state = sample_state()
    back = load(_save(ckpt, state, tmp_path / "a"))
    assert_same(state, back)
    # non-tensor leaves keep their types, including int dict keys and tuples
    assert back["plain"]["int_keys"] == {0: "a", 1: "b", "2": "c"}
    assert isinstance(back["plain"]["tuple"][1], tuple)
    assert back["plain"]["dtype"] is torch.bfloat16
    # optimizer state loads back into an optimizer
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(back["optim"])
    model.load_state_dict(back["model"])
    torch.set_rng_state(back["rng"])  # reads from the storage's start, not the tensor's
    assert torch.equal(torch.get_rng_state(), state["rng"])


def test_shared_storage_is_written_once_and_stays_shared(ckpt, tmp_path) -> None:
    big = torch.randn(256, 256)  # 256 KiB
    state = {"w": big, "t": big.t(), "half": big[:128], "alias": big}
    path = _save(ckpt, state, tmp_path / "shared")
    header = read_header(path)
    assert len(header.entries) == 1, header.entries
    assert header.file_size < big.numel() * 4 + 2 * ALIGN  # once, not four times
    back = load(path)
    assert_same(state, back)
    ptr = back["w"].untyped_storage().data_ptr()
    assert all(back[k].untyped_storage().data_ptr() == ptr for k in state)
    back["w"][0, 0] = 123.0  # a private mapping: writes are seen by every view...
    assert back["t"][0, 0] == 123.0 and back["alias"][0, 0] == 123.0
    assert load(path)["w"][0, 0] == big[0, 0]  # ...and never by the file


def test_a_slice_alone_stores_only_its_elements(ckpt, tmp_path) -> None:
    big = torch.randn(1024, 1024)
    path = _save(ckpt, {"row": big[5]}, tmp_path / "slice")
    assert os.path.getsize(path) < 3 * ALIGN
    assert torch.equal(load(path)["row"], big[5])


def test_data_is_aligned_and_tensors_start_on_their_element_size(ckpt, tmp_path) -> None:
    path = _save(ckpt, sample_state(), tmp_path / "al")
    header = read_header(path)
    assert header.data_start % ALIGN == 0
    itemsize = {"F64": 8, "I64": 8, "C64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2}
    for name, (dtype, _, begin, _) in header.entries.items():
        assert begin % itemsize.get(dtype, 1) == 0, name


def test_safetensors_package_reads_the_file(ckpt, tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    state = sample_state()
    path = _save(ckpt, state, tmp_path / "st.safetensors")
    tensors = load_file(str(path))
    assert torch.equal(tensors["model.weight"], state["model"]["weight"])
    assert torch.equal(tensors["tensors.bf16"], state["tensors"]["bf16"])
    assert torch.equal(tensors["tensors.noncontig"], state["tensors"]["noncontig"])
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "trainguard"
    assert set(json.loads(meta["checksums"])) == set(tensors)


def test_torch_format_reads_with_plain_torch_load(ckpt, tmp_path) -> None:
    state = sample_state()
    del state["plain"]["bytes"]  # weights_only=True refuses bytes; torch's rule, not ours
    del state["views"]["bytes"]  # torch.save refuses views of one storage as two dtypes
    path = _save(ckpt, state, tmp_path / "t.pt", format="torch")
    back = torch.load(path, weights_only=True)
    assert_same(state, back)
    views = back["views"]
    assert views["wt"].untyped_storage().data_ptr() == views["w"].untyped_storage().data_ptr()
    assert_same(state, load(path))


def test_flipped_byte_names_the_tensor(ckpt, tmp_path) -> None:
    state = {"a": torch.zeros(1000), "b": torch.ones(1000), "c": torch.arange(10)}
    path = _save(ckpt, state, tmp_path / "flip")
    header = read_header(path)
    _, _, begin, _ = header.entries["b"]
    with open(path, "r+b") as f:
        f.seek(header.data_start + begin + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointCorruptError, match="'b'"):
        load(path)
    assert torch.equal(load(path, verify=False)["a"], state["a"])  # the opt-out


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_file_gives_a_clear_error(ckpt, tmp_path, cut) -> None:
    path = _save(ckpt, {"a": torch.randn(10000)}, tmp_path / "trunc")
    size = os.path.getsize(path)
    os.truncate(path, cut if cut >= 0 else size - 1)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        load(path)


def test_garbage_header_is_corrupt_not_a_crash(tmp_path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\x00" * 100)
    with pytest.raises(CheckpointCorruptError, match="malformed"):
        load(path)


def test_unjsonable_leaf_needs_pickle_on_both_sides(ckpt, tmp_path) -> None:
    state = {"model": {"w": torch.ones(2)}, "cfg": {"obj": {1, 2, 3}}}
    with pytest.raises(CheckpointPickleError, match=r"state\['cfg'\]\['obj'\].*pickle=True"):
        ckpt.save(state, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    path = _save(ckpt, state, tmp_path / "p", pickle=True)
    with pytest.raises(CheckpointPickleError, match=r"state\['cfg'\]\['obj'\].*allow_pickle"):
        load(path)
    assert load(path, allow_pickle=True)["cfg"]["obj"] == {1, 2, 3}


def test_flatten_rejects_sparse_tensors_by_key() -> None:
    with pytest.raises(CheckpointError, match=r"state\['s'\]"):
        flatten({"s": torch.eye(3).to_sparse()})
