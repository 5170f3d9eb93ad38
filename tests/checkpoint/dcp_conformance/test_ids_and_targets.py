"""Where checkpoints live and what they load into, on both storage layers: explicit
``no_dist``, a moved checkpoint directory, one reader reused for several ids, the storage
metadata, parameters that require grad, non-contiguous targets, ``Stateful`` objects through
``async_save``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.checkpoint.dcp_conformance._layers import Layer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def test_explicit_no_dist(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"t": torch.arange(3.0)}, storage_writer=layer.writer(tmp_path / "c"), no_dist=True)
    target = {"t": torch.zeros(3)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"), no_dist=True)
    assert torch.equal(target["t"], torch.arange(3.0))


def test_a_moved_checkpoint_directory_still_loads(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"t": torch.arange(4.0)}, storage_writer=layer.writer(tmp_path / "c"))
    shutil.move(tmp_path / "c", tmp_path / "moved")
    target = {"t": torch.zeros(4)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "moved"))
    assert torch.equal(target["t"], torch.arange(4.0))


def test_one_reader_reused_for_several_ids(layer: Layer, tmp_path: Path) -> None:
    writer = layer.writer(tmp_path / "unused")
    for step in (1, 2):
        dcp.save(
            {"t": torch.full((2,), float(step))},
            checkpoint_id=tmp_path / f"s{step}",
            storage_writer=writer,
        )
    reader = layer.reader(tmp_path / "s1")
    for step in (1, 2, 1):
        target = {"t": torch.zeros(2)}
        dcp.load(target, checkpoint_id=tmp_path / f"s{step}", storage_reader=reader)
        assert torch.equal(target["t"], torch.full((2,), float(step)))


def test_the_metadata_names_the_checkpoint(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"t": torch.ones(2)}, storage_writer=layer.writer(tmp_path / "c"))
    metadata = layer.reader(tmp_path / "c").read_metadata()
    assert metadata.storage_meta is not None
    assert str(metadata.storage_meta.checkpoint_id) == str(tmp_path / "c")
    assert metadata.version is not None


def test_parameters_that_require_grad(layer: Layer, tmp_path: Path) -> None:
    state = {"p": nn.Parameter(torch.arange(3.0)), "buffer": torch.ones(2)}
    dcp.save(state, storage_writer=layer.writer(tmp_path / "c"))
    target = {"p": nn.Parameter(torch.zeros(3)), "buffer": torch.zeros(2)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert isinstance(target["p"], nn.Parameter) and target["p"].requires_grad
    assert torch.equal(target["p"].detach(), torch.arange(3.0))


def test_load_into_non_contiguous_targets(layer: Layer, tmp_path: Path) -> None:
    value = torch.arange(12.0).reshape(3, 4)
    dcp.save({"t": value}, storage_writer=layer.writer(tmp_path / "c"))
    base = torch.zeros(4, 3)
    target = {"t": base.t()}  # a transposed view: DCP loads into it in place
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert torch.equal(target["t"], value) and torch.equal(base, value.t())


class _Trainer:
    def __init__(self, step: int) -> None:
        self.step = step
        self.w = torch.full((3,), float(step))

    def state_dict(self) -> dict[str, object]:
        return {"step": self.step, "w": self.w}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step = state["step"]  # type: ignore[assignment]
        self.w = state["w"]  # type: ignore[assignment]


def test_stateful_objects_through_async_save(layer: Layer, tmp_path: Path) -> None:
    trainer = _Trainer(3)
    dcp.async_save({"trainer": trainer}, storage_writer=layer.writer(tmp_path / "c")).result()
    back = _Trainer(0)
    dcp.load({"trainer": back}, storage_reader=layer.reader(tmp_path / "c"))
    assert back.step == 3 and torch.equal(back.w, torch.full((3,), 3.0))
