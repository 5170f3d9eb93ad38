"""Conversions between a DCP checkpoint and a single ``torch.save`` file, each layer with its
own pair (torch's ``format_utils`` for its layer, ``trainguard.checkpoint.dcp``'s for ours)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.checkpoint.dcp_conformance._layers import Layer
from tests.checkpoint.dcp_conformance._states import Net, assert_same, trained

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def test_dcp_to_torch_save(layer: Layer, tmp_path: Path) -> None:
    net = Net(4)
    dcp.save({"model": net.state_dict()}, storage_writer=layer.writer(tmp_path / "c"))
    layer.to_torch_save(tmp_path / "c", str(tmp_path / "model.pt"))
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_same(back, {"model": net.state_dict()})


def test_dcp_to_torch_save_of_model_optimizer_and_values(layer: Layer, tmp_path: Path) -> None:
    net, opt = trained(5)
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "step": 9}
    dcp.save(state, storage_writer=layer.writer(tmp_path / "c"))
    layer.to_torch_save(tmp_path / "c", str(tmp_path / "all.pt"))
    back = torch.load(tmp_path / "all.pt", weights_only=False)
    assert back["step"] == 9
    assert_same(back["model"], net.state_dict())
    # DCP's flattening names optimizer state by string keys ("0"), with either layer
    want = {str(k): v for k, v in opt.state_dict()["state"].items()}
    assert_same(back["optim"]["state"], want)


def test_torch_save_to_dcp(layer: Layer, tmp_path: Path) -> None:
    state = {"model": Net(6).state_dict()}
    torch.save(state, tmp_path / "model.pt")
    layer.from_torch_save(str(tmp_path / "model.pt"), tmp_path / "c")
    net = Net(7)
    target = {"model": net.state_dict()}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert_same(net.state_dict(), state["model"])
