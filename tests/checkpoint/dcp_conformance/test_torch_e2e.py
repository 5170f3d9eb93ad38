"""torch's own end-to-end DCP tests, by behaviour, on both storage layers (two gloo ranks).

What ``test/distributed/checkpoint/e2e/test_e2e_save_and_load.py`` and the sharded-tensor
cases of ``test_file_system_checkpoint.py`` in torch's repository check, ported to CPU and
gloo (FSDP2 where torch's test uses FSDP, which needs an accelerator), with our
``StorageWriter``/``StorageReader`` in place of ``FileSystemWriter``/``FileSystemReader`` on
the trainguard layer. ``async_save`` goes through torch's real ``DefaultStager`` on both
executors. Each layer starts its two ranks once (see ``_torch_e2e.run``); every test checks
one case, by torch's test name."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import run_ranks
from tests.checkpoint.dcp_conformance import _torch_e2e
from tests.checkpoint.dcp_conformance._layers import LAYERS

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # DCP's and FSDP's notices
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(400),
]


@pytest.fixture(scope="module", params=LAYERS)
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(f"torch_e2e_{request.param}")
    results = run_ranks(_torch_e2e.run, 2, args=(str(root), request.param), timeout=380)
    return request.param, [r.get() for r in results]


def _case(ranks: Any, name: str) -> list[dict[str, Any]]:
    layer, outs = ranks
    for rank, out in enumerate(outs):
        assert "error" not in out[name], f"{layer}, rank {rank}: {out[name]['error']}"
    return [out[name] for out in outs]


def _e2e(out: dict[str, Any]) -> None:
    assert out["stateful"], "the Stateful object did not come back"
    assert out["train_state"], "the train state (a BytesIO inside) did not come back"
    assert out["loss"], "one more step after the load differs from the model never saved"
    assert out["model"] and out["optim_keys"], out


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_e2e(ranks: Any, kind: str) -> None:
    for out in _case(ranks, f"e2e_{kind}"):
        _e2e(out)


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("zoc", [False, True], ids=["staged", "async_staging"])
def test_e2e_async_with_default_stager(ranks: Any, executor: str, zoc: bool) -> None:
    """torch's ``test_e2e_async_cached`` with a ``DefaultStager`` (not cached)."""
    for out in _case(ranks, f"async_{executor}{'_zoc' if zoc else ''}"):
        _e2e(out)


def test_partial_load(ranks: Any) -> None:
    for out in _case(ranks, "partial_load"):
        assert out == {
            "model": True,
            "keys_model": True,
            "keys_optim_only_state": True,
            "keys_optim": True,
        }


def test_different_ordered_state_dict_keys(ranks: Any) -> None:
    for out in _case(ranks, "ordered_keys"):
        assert out == {"gathered": [1, 2, 3, 4], "summed": [4, 6]}


def test_overwrite(ranks: Any) -> None:
    for out in _case(ranks, "overwrite"):
        assert out["replaced"] and out["kept"], out
        assert out["refused"] is not None, "overwrite=False saved over a checkpoint"
        assert "Checkpoint already exists" in out["refused"], out["refused"]


def test_sharded_tensor_resharding_and_bytes(ranks: Any) -> None:
    outs = _case(ranks, "sharded_tensors")
    saved = outs[0]["saved"]
    assert saved is not None and len(saved) == 10
    assert outs[0]["cols"] == saved and outs[0]["uneven"] == saved
    for out in outs:
        assert out["cols_bytes"] == out["uneven_bytes"] == ([1], "string")
