"""Load planning on both storage layers: loading a subset, missing and extra keys, partial
loads, shape and dtype mismatches, planners that do not flatten, the metadata a planner sees."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from tests.checkpoint.dcp_conformance._layers import Layer
from tests.checkpoint.dcp_conformance._states import assert_same, like

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def _saved(layer: Layer, path: Path) -> dict[str, object]:
    state = {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.arange(4, dtype=torch.int32),
        "nested": {"c": torch.ones(5), "n": 3},
    }
    dcp.save(state, storage_writer=layer.writer(path))
    return state


def test_load_a_subset_of_the_saved_keys(layer: Layer, tmp_path: Path) -> None:
    state = _saved(layer, tmp_path / "c")
    target = {"b": torch.zeros(4, dtype=torch.int32)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert_same(target, {"b": state["b"]})


def test_a_key_missing_from_the_checkpoint_fails_the_load(layer: Layer, tmp_path: Path) -> None:
    _saved(layer, tmp_path / "c")
    target = {"a": torch.zeros(2, 3), "not_saved": torch.zeros(2)}
    with pytest.raises(CheckpointException, match="not_saved"):
        dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))


def test_partial_load_skips_keys_the_checkpoint_lacks(layer: Layer, tmp_path: Path) -> None:
    state = _saved(layer, tmp_path / "c")
    target = {"a": torch.zeros(2, 3), "not_saved": torch.full((2,), 9.0)}
    dcp.load(
        target,
        storage_reader=layer.reader(tmp_path / "c"),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    assert torch.equal(target["a"], state["a"])  # type: ignore[arg-type]
    assert torch.equal(target["not_saved"], torch.full((2,), 9.0))


def test_a_shape_mismatch_fails_the_load(layer: Layer, tmp_path: Path) -> None:
    _saved(layer, tmp_path / "c")
    with pytest.raises(CheckpointException, match=r"[Ss]ize|shape"):
        dcp.load({"a": torch.zeros(3, 3)}, storage_reader=layer.reader(tmp_path / "c"))


def test_load_casts_to_the_targets_dtype(layer: Layer, tmp_path: Path) -> None:
    state = {"w": torch.rand(4, 3, dtype=torch.float32)}
    dcp.save(state, storage_writer=layer.writer(tmp_path / "c"))
    target = {"w": torch.zeros(4, 3, dtype=torch.float64)}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert target["w"].dtype == torch.float64
    assert torch.equal(target["w"], state["w"].double())
    narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(narrow, storage_reader=layer.reader(tmp_path / "c"))
    assert torch.equal(narrow["w"], state["w"].bfloat16())


@pytest.mark.skipif(
    "allow_unsafe_types" not in inspect.signature(DefaultLoadPlanner).parameters,
    reason="this torch's DefaultLoadPlanner has no allow_unsafe_types",
)
def test_a_strict_planner_refuses_narrowing_casts(layer: Layer, tmp_path: Path) -> None:
    dcp.save({"w": torch.rand(4, 3)}, storage_writer=layer.writer(tmp_path / "c"))
    strict = DefaultLoadPlanner(allow_unsafe_types=False)  # type: ignore[call-arg]
    with pytest.raises(CheckpointException, match="dtype mismatch"):
        dcp.load(
            {"w": torch.zeros(4, 3, dtype=torch.bfloat16)},
            storage_reader=layer.reader(tmp_path / "c"),
            planner=strict,
        )


def test_planners_that_do_not_flatten(layer: Layer, tmp_path: Path) -> None:
    state = {"a": torch.arange(3.0), "b": torch.ones(2, 2)}
    dcp.save(
        state,
        storage_writer=layer.writer(tmp_path / "c"),
        planner=DefaultSavePlanner(flatten_state_dict=False),
    )
    target = like(state)
    dcp.load(
        target,
        storage_reader=layer.reader(tmp_path / "c"),
        planner=DefaultLoadPlanner(flatten_state_dict=False),
    )
    assert_same(target, state)


def test_a_nested_state_loads_through_the_flattening_planner(layer: Layer, tmp_path: Path) -> None:
    state = {"m": {"x": {"y": torch.arange(4.0)}}, "l": [torch.ones(1), {"z": torch.zeros(2)}]}
    dcp.save(state, storage_writer=layer.writer(tmp_path / "c"))
    metadata = layer.reader(tmp_path / "c").read_metadata()
    assert set(metadata.state_dict_metadata) == {"m.x.y", "l.0", "l.1.z"}
    target = {"m": {"x": {"y": torch.zeros(4)}}, "l": [torch.zeros(1), {"z": torch.ones(2)}]}
    dcp.load(target, storage_reader=layer.reader(tmp_path / "c"))
    assert_same(target, state)


def test_a_custom_save_planner_that_drops_keys(layer: Layer, tmp_path: Path) -> None:
    class _SkipPrivate(DefaultSavePlanner):
        def set_up_planner(self, state_dict, *args, **kwargs):  # type: ignore[no-untyped-def]
            kept = {k: v for k, v in state_dict.items() if not k.startswith("_")}
            super().set_up_planner(kept, *args, **kwargs)

    state = {"keep": torch.ones(2), "_private": torch.zeros(2)}
    dcp.save(state, storage_writer=layer.writer(tmp_path / "c"), planner=_SkipPrivate())
    metadata = layer.reader(tmp_path / "c").read_metadata()
    assert set(metadata.state_dict_metadata) == {"keep"}
