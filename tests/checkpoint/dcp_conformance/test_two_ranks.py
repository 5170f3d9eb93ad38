"""Two ranks (gloo) on both storage layers: replicated and rank-own keys, DTensor resharding
(rows to columns, to replicated, to and from plain tensors, uneven shards), a DDP model and its
optimizer through ``torch.distributed.checkpoint.state_dict``, ``async_save`` and overwrite.
Each layer starts its two ranks once (see ``_two_ranks.run``); every test checks one part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests._dist import run_ranks
from tests.checkpoint.dcp_conformance import _two_ranks
from tests.checkpoint.dcp_conformance._layers import LAYERS, Layer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


@pytest.fixture(scope="module", params=LAYERS)
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(f"two_ranks_{request.param}")
    results = run_ranks(_two_ranks.run, 2, args=(str(root), request.param), timeout=170)
    return request.param, root, [r.get() for r in results]


def test_replicated_state_is_saved_once_and_loaded_by_every_rank(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["replicated"] == (torch.arange(12.0).reshape(3, 4).tolist(), 5)
        assert out["replicated_chunks"] == 1  # deduplicated: one rank wrote it


def test_keys_saved_by_one_rank_load_on_every_rank(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["own_keys"] == {"r0": [0.0, 0.0], "r1": [1.0, 1.0]}


@pytest.mark.parametrize("name", ["rows", "cols", "rep"])
def test_dtensor_resharding_on_load(ranks: Any, name: str) -> None:
    _, _, outs = ranks
    assert all(out[f"reshard_{name}"] for out in outs)


def test_sharded_to_plain_and_plain_to_sharded(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["sharded_to_plain"] and out["plain_to_sharded"] for out in outs)


def test_ddp_model_and_optimizer_through_the_state_dict_api(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["ddp_params"] and out["ddp_optim"] for out in outs)


def test_async_save_from_two_ranks_and_its_overwrite(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["async_1"] == {"t0": [1.0] * 4, "t1": [11.0] * 4}
        assert out["async_2"] == {"t0": [2.0] * 4, "t1": [12.0] * 4}


def test_overwrite_from_two_ranks_and_refusal(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["overwritten"] == [7.0, 7.0]
        assert out["refused"] is True


def test_a_two_rank_checkpoint_loads_in_one_process(ranks: Any) -> None:
    name, root, _ = ranks
    with Layer(name) as layer:
        target = {"d": torch.zeros(7, 10)}
        dcp.load(target, storage_reader=layer.reader(Path(root) / "dt"), no_dist=True)
    assert torch.equal(target["d"], torch.arange(70.0).reshape(7, 10))


def test_a_caching_planner_saving_again_to_one_id(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["cached_plans"] == [
            {"c": [s] * 3, "own0": [s] * 2, "own1": [s + 1] * 2} for s in (1.0, 2.0, 3.0)
        ]


def test_fsdp2_model_and_optimizer_resume_identically(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["fsdp_params"] is True
        before, after = out["fsdp_next_loss"]
        assert before == after  # the resumed model trains on exactly as the saved one


def test_an_fsdp2_checkpoint_consolidates_into_one_torch_save_file(ranks: Any) -> None:
    name, root, _ = ranks
    with Layer(name) as layer:
        layer.to_torch_save(Path(root) / "fsdp", str(Path(root) / f"fsdp_{name}.pt"))
    state = torch.load(Path(root) / f"fsdp_{name}.pt", weights_only=False)
    shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    assert shapes == {"0.weight": (8, 5), "0.bias": (8,), "2.weight": (3, 8), "2.bias": (3,)}
    assert set(state["optim"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_ranks_with_differently_ordered_keys(ranks: Any) -> None:
    _, _, outs = ranks
    for out in outs:
        assert out["key_order"] == {"k1": [1.0, 1.0], "k2": [2.0] * 3, "k3": 3}


def test_save_and_load_on_a_process_group_of_their_own(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["own_group"] == [4.0, 4.0] for out in outs)


def test_async_save_on_a_process_group_of_its_own(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["async_own_group"] == [6.0, 6.0] for out in outs)


def test_a_planner_that_saves_replicas_from_the_lowest_rank(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["lowest_rank"] == [0.0, 1.0, 2.0, 3.0, 4.0] for out in outs)


def test_a_dtensor_with_an_empty_local_shard(ranks: Any) -> None:
    _, _, outs = ranks
    assert all(out["empty_shard"] for out in outs)
