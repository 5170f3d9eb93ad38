"""torch's single-process DCP tests, by behaviour, on both storage layers.

From ``e2e/test_e2e_save_and_load.py`` (``test_stateful_and_non_stateful_loads``,
``test_no_dist``, ``test_init_state_dict``) and ``test_format_utils.py``
(``test_dcp_to_torch_save``, ``test_torch_save_to_dcp``, which save and load a module itself,
not its state dict) in torch's repository. Each layer converts with its own ``format_utils``
(torch's ``dcp_to_torch_save`` reads with ``FileSystemReader``, which cannot read our files: see
docs/dcp.md, "Formats")."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from tests.checkpoint.dcp_conformance._layers import Layer
from tests.checkpoint.dcp_conformance._states import assert_same
from tests.checkpoint.dcp_conformance._torch_e2e import Dummy
from trainguard.checkpoint.dcp import StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


class _Recording(dict):  # type: ignore[type-arg]
    """A state dict that records whether a load assigned to it."""

    assigned = False

    def __setitem__(self, key: Any, value: Any) -> None:
        self.assigned = True
        super().__setitem__(key, value)


class _Loaded(Stateful):
    called = False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.called = True


def test_stateful_and_non_stateful_loads(layer: Layer, tmp_path: Path) -> None:
    sd = _Recording()
    sd["foo"] = stateful = _Loaded()
    sd.assigned = False
    dcp.save(sd, storage_writer=layer.writer(tmp_path / "a"))
    dcp.load(sd, storage_reader=layer.reader(tmp_path / "a"))
    assert stateful.called, "a Stateful is loaded in place"
    assert not sd.assigned, "a Stateful is not replaced in its state dict"

    sd = _Recording()
    sd["foo"] = {"replicated": torch.rand(4, 4), "bytes": [1, 2, 3, 4]}
    sd.assigned = False
    dcp.save(sd, storage_writer=layer.writer(tmp_path / "b"))
    dcp.load(sd, storage_reader=layer.reader(tmp_path / "b"))
    assert sd.assigned, "a plain state dict's values are replaced by the loaded ones"


def test_no_dist_empty_state(layer: Layer, tmp_path: Path) -> None:
    dcp.save({}, storage_writer=layer.writer(tmp_path / "c"))
    target: dict[str, Any] = {}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert target == {}


def test_init_state_dict(layer: Layer, tmp_path: Path) -> None:
    model = Dummy()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    saved = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim),
    }
    dcp.save(saved, storage_writer=layer.writer(tmp_path / "c"))

    model2 = Dummy()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.2)  # a value that is not a tensor
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, optim2)
    target = {"model": msd, "optimizer": osd}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert target["model"] is msd and target["optimizer"] is osd, "DCP loads in place"
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    assert_same(get_model_state_dict(model2), msd)
    assert optim2.param_groups[0]["lr"] == 0.1


def test_dcp_to_torch_save_of_a_module(layer: Layer, tmp_path: Path) -> None:
    model = Dummy()
    dcp.save({"model": model}, storage_writer=layer.writer(tmp_path / "c"))
    layer.to_torch_save(tmp_path / "c", str(tmp_path / "model.pt"))
    assert_same(torch.load(tmp_path / "model.pt", weights_only=True), {"model": model.state_dict()})


def test_torch_save_to_dcp_into_a_module(layer: Layer, tmp_path: Path) -> None:
    torch.manual_seed(9)
    saved = {"model": torch.nn.Linear(4, 3).state_dict()}
    torch.save(saved, tmp_path / "model.pt")
    layer.from_torch_save(str(tmp_path / "model.pt"), tmp_path / "c")
    model = torch.nn.Linear(4, 3)
    dcp.load({"model": model}, storage_reader=layer.reader(tmp_path / "c"))
    assert_same({"model": model.state_dict()}, saved)


def test_torchs_dcp_to_torch_save_cannot_read_our_files(tmp_path: Path) -> None:
    """The one difference that stays (docs/dcp.md, "Formats"): torch's converter reads with
    ``FileSystemReader``, which reads DCP's own ``.distcp`` records, never our safetensors."""
    with StorageWriter(tmp_path / "c") as writer:
        dcp.save({"model": Dummy()}, storage_writer=writer)
    # its reader meets our (file, entry) pairs where it wants a path, offset and length
    with pytest.raises(CheckpointException, match="has no attribute 'relative_path'"):
        format_utils.dcp_to_torch_save(tmp_path / "c", tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_a_bytesio_value_comes_back_as_a_bytesio(layer: Layer, tmp_path: Path) -> None:
    """DCP's way to save raw bytes (torch's e2e train state, a data loader's state): our reader
    lets ``BytesIO`` through its ``weights_only`` check; nothing else is widened."""
    blob = io.BytesIO(b"loader position 17")
    dcp.save({"loader": blob, "t": torch.ones(2)}, storage_writer=layer.writer(tmp_path / "c"))
    target: dict[str, Any] = {"loader": io.BytesIO(), "t": torch.zeros(2)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert isinstance(target["loader"], io.BytesIO)
    assert target["loader"].getvalue() == b"loader position 17"
