"""Saving again to a checkpoint id (overwrite, as DCP's file system layer does by default) and
``dcp.async_save`` on both storage layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.checkpoint.dcp_conformance._layers import Layer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's notices


def _value(layer: Layer, path: Path) -> float:
    target = {"t": torch.zeros(3)}
    dcp.load(target, storage_reader=layer.reader(path))
    assert torch.equal(target["t"], target["t"][:1].expand(3))
    return float(target["t"][0])


def test_saving_again_overwrites_by_default(layer: Layer, tmp_path: Path) -> None:
    writer = layer.writer(tmp_path / "c")
    for step in (1.0, 2.0, 3.0):
        dcp.save({"t": torch.full((3,), step)}, storage_writer=writer)
        assert _value(layer, tmp_path / "c") == step


def test_overwrite_with_a_new_writer_and_fewer_keys(layer: Layer, tmp_path: Path) -> None:
    dcp.save(
        {"t": torch.ones(3), "old": torch.ones(2)}, storage_writer=layer.writer(tmp_path / "c")
    )
    dcp.save({"t": torch.full((3,), 5.0)}, storage_writer=layer.writer(tmp_path / "c"))
    assert _value(layer, tmp_path / "c") == 5.0
    metadata = layer.reader(tmp_path / "c").read_metadata()
    assert set(metadata.state_dict_metadata) == {"t"}  # nothing of the old save remains


def test_overwrite_false_refuses_an_existing_checkpoint(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"t": torch.ones(3)}, storage_writer=layer.writer(tmp_path / "c"))
    with pytest.raises(CheckpointException, match=r"already exists|already a committed"):
        dcp.save(
            {"t": torch.zeros(3)}, storage_writer=layer.writer(tmp_path / "c", overwrite=False)
        )
    assert _value(layer, tmp_path / "c") == 1.0


def test_overwrite_false_writes_a_new_checkpoint(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"t": torch.ones(3)}, storage_writer=layer.writer(tmp_path / "c", overwrite=False))
    assert _value(layer, tmp_path / "c") == 1.0


def test_async_save_round_trip(layer: Layer, tmp_path: Path) -> None:
    future = dcp.async_save(
        {"t": torch.full((3,), 4.0)}, storage_writer=layer.writer(tmp_path / "c")
    )
    future.result()
    assert _value(layer, tmp_path / "c") == 4.0


def test_async_save_holds_the_state_at_the_call(layer: Layer, tmp_path: Path) -> None:
    state = {"t": torch.full((3,), 1.0)}
    future = dcp.async_save(state, storage_writer=layer.writer(tmp_path / "c"))
    state["t"].fill_(2.0)  # changed right after the call: the checkpoint holds the staged copy
    future.result()
    assert _value(layer, tmp_path / "c") == 1.0


def test_async_saves_in_a_row_to_one_id(layer: Layer, tmp_path: Path) -> None:
    writer = layer.writer(tmp_path / "c")
    for step in (1.0, 2.0):
        dcp.async_save({"t": torch.full((3,), step)}, storage_writer=writer).result()
        assert _value(layer, tmp_path / "c") == step


def test_async_saves_to_new_ids(layer: Layer, tmp_path: Path) -> None:
    writer = layer.writer(tmp_path / "unused")
    futures = []
    for step in (1, 2):
        futures.append(
            dcp.async_save(
                {"t": torch.full((3,), float(step))},
                checkpoint_id=tmp_path / f"s{step}",
                storage_writer=writer,
            )
        )
        futures[-1].result()  # one save at a time per writer, as DCP's docs ask
    assert [_value(layer, tmp_path / f"s{s}") for s in (1, 2)] == [1.0, 2.0]
