"""What each of two ranks does for the behaviours of torch's own end-to-end DCP tests
(``test/distributed/checkpoint/e2e/test_e2e_save_and_load.py`` and the sharded-tensor cases of
``test_file_system_checkpoint.py`` in torch's repository), on CPU and gloo, on one storage
layer. One start of two ranks per layer runs every case; each case returns plain values that
the tests compare, or the error it raised (``"error"``), so one failing case fails one test.

The cases, by torch's test names: ``test_e2e`` (FSDP2 and DDP models, a ``Stateful`` object and
a train state holding a ``BytesIO``, saved with ``dcp.save``, loaded into fresh models, then one
more step must match a model that never went through a checkpoint), ``test_e2e_async_cached``
(the same through ``dcp.async_save`` with torch's ``DefaultStager``, on the THREAD and the
PROCESS executor, with and without its async staging), ``test_partial_load``,
``test_different_ordered_state_dict_keys``, ``test_overwrite``, and the resharding of
``ShardedTensor`` state (rows to columns, to an uneven enumerable sharding).
"""

from __future__ import annotations

import io
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

#: how long one async save may take before the case reports a hang (the test's limit is longer)
ASYNC_LIMIT = 90.0


class Dummy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 32)
        self.l3 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.l1(x))
        return torch.relu(self.l3(torch.relu(self.l2(x))))


class Blob:
    """A Stateful object with one random tensor (arbitrary objects saved through DCP)."""

    def __init__(self) -> None:
        self.data = torch.rand(6, 6)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["data"]


class TrainState:
    """Step, last loss and the loss history; the history goes through DCP as a ``BytesIO``."""

    def __init__(self) -> None:
        self.step = 0
        self.loss = -1.0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        history = io.BytesIO()
        torch.save(self.losses, history)
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "loss": torch.tensor(self.loss),
            "losses": history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"].item())
        self.loss = float(state["loss"].item())
        state["losses"].seek(0)
        self.losses = torch.load(state["losses"], weights_only=True)

    def value(self) -> tuple[int, float, list[float]]:
        return self.step, self.loss, self.losses


def _model(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        _patch_model_state_dict,
        _patch_optimizer_state_dict,
    )

    model: torch.nn.Module = Dummy()
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for part in (model.l1, model.l2, model.l3):
            fully_shard(part, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if kind != "plain":  # model.state_dict() then gives DCP's (sharded) state dicts
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> Any:
    torch.manual_seed(0)  # the same inputs on every rank and for every model
    state, loss = TrainState(), torch.zeros(())
    for _ in range(steps):
        loss = model(torch.rand(8, 8)).sum()
        loss.backward()
        state.step += 1
        state.loss = float(torch.rand(1))
        state.losses.append(state.loss)
        optim.step()
        optim.zero_grad()
    return loss.detach(), state


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _same_state(a: Any, b: Any) -> bool:
    """Whether two (nested) state dicts hold equal values, DTensors compared whole."""
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(_full(a), _full(b))
    return bool(a == b)


def _async(layer: Any, sd: dict[str, Any], path: str, executor: str, zoc: bool) -> None:
    """``dcp.async_save`` through torch's DefaultStager (not cached), then wait for it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
    options = StagingOptions(
        use_pinned_memory=False,  # no CUDA here
        use_shared_memory=executor == "process",
        use_async_staging=zoc,
        use_non_blocking_copy=False,  # needs an accelerator
    )
    stager = DefaultStager(options)
    try:
        got = dcp.async_save(
            sd, storage_writer=layer.writer(path), async_checkpointer_type=kind, async_stager=stager
        )
        future = got.upload_completion if hasattr(got, "upload_completion") else got
        deadline = time.monotonic() + ASYNC_LIMIT
        while not future.done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"async_save ({executor}, zoc={zoc}) not done after 90 s")
            time.sleep(0.05)
        future.result()
    finally:
        stager.close()


def e2e(layer: Any, root: str, kind: str, save: str = "sync", zoc: bool = False) -> dict[str, Any]:
    """torch's ``_run_e2e_test``: train a plain and a parallel model 2 steps, save the parallel
    one (model, optimizer, a Stateful, a train state), load into fresh ones, train both 1 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = f"{root}/e2e-{kind}-{save}-{int(zoc)}"
    plain, plain_opt = _model("plain")
    _train(plain, plain_opt, 2)
    model, optim = _model(kind)
    _, train_state = _train(model, optim, 2)
    blob = Blob()
    sd = {"model": model, "optimizer": optim, "s": blob, "train_state": train_state}
    if save == "sync":
        dcp.save(sd, storage_writer=layer.writer(path))
    else:
        _async(layer, sd, path, save, zoc)

    loaded_blob, loaded_state = Blob(), TrainState()
    model, optim = _model(kind)
    target = {"model": model, "optimizer": optim, "s": loaded_blob, "train_state": loaded_state}
    dcp.load(target, storage_reader=layer.reader(path))
    out: dict[str, Any] = {
        "stateful": torch.equal(blob.data, loaded_blob.data),
        "train_state": loaded_state.value() == train_state.value(),
    }
    loss, _ = _train(plain, plain_opt, 1)
    dist_loss, _ = _train(model, optim, 1)
    out["loss"] = bool(torch.equal(loss, dist_loss))
    msd, osd = get_state_dict(model, optimizers=optim)
    plain_msd, _ = get_state_dict(plain, optimizers=plain_opt)
    out["model"] = all(torch.allclose(_full(v), plain_msd[k]) for k, v in msd.items())
    out["optim_keys"] = sorted(osd["state"]) == sorted(n for n, _ in plain.named_parameters())
    return out


def partial_load(layer: Any, root: str) -> dict[str, Any]:
    """torch's ``test_partial_load``: save model and optimizer, load only the model; load keys
    alone without a state to load into (``_load_state_dict_from_keys``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = f"{root}/partial"
    model, optim = _model("fsdp")
    _train(model, optim, 2)
    dcp.save({"model": model, "optimizer": optim}, storage_writer=layer.writer(path))
    fresh, _ = _model("fsdp")
    dcp.load({"model": fresh}, storage_reader=layer.reader(path))
    saved = get_model_state_dict(model)
    out = {"model": _same_state(saved, get_model_state_dict(fresh))}
    by_key = _load_state_dict_from_keys("model", storage_reader=layer.reader(path))["model"]
    out["keys_model"] = all(torch.equal(_full(v), by_key[k]) for k, v in saved.items())
    state = _load_state_dict_from_keys("optimizer.state", storage_reader=layer.reader(path))
    got = state["optimizer"]["state"]
    out["keys_optim_only_state"] = "param_groups" not in got
    want = optim.state_dict()["state"]
    out["keys_optim"] = sorted(got) == sorted(want) and all(
        torch.equal(_full(want[k][name]), got[k][name])
        for k in want
        for name in ("exp_avg", "exp_avg_sq", "step")
    )
    return out


def ordered_keys(layer: Any, root: str) -> dict[str, Any]:
    """torch's ``test_different_ordered_state_dict_keys``: Stateful objects whose loads run
    collectives, in a different key order on each rank, must not deadlock."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[str, Any] = {}

    class Gathers:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            parts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(parts, torch.arange(2) + 1 + 2 * rank)
            seen["gathered"] = torch.cat(parts).tolist()

    class Sums:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            total = torch.arange(2) + 1 + 2 * rank
            dist.all_reduce(total)
            seen["summed"] = total.tolist()

    sd = {"A": Gathers(), "B": Sums()} if rank == 0 else {"B": Sums(), "A": Gathers()}
    dcp.save(sd, storage_writer=layer.writer(f"{root}/ordered"))
    dcp.load(sd, storage_reader=layer.reader(f"{root}/ordered"))
    return seen


def overwrite(layer: Any, root: str) -> dict[str, Any]:
    """torch's ``test_overwrite``: a second save replaces the first (overwrite=True), and
    overwrite=False raises ``CheckpointException`` saying "Checkpoint already exists"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.utils import CheckpointException

    path = f"{root}/overwrite"
    torch.manual_seed(3)
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=layer.writer(path))
    dcp.save({"random": t2}, storage_writer=layer.writer(path, overwrite=True))
    back = {"random": torch.zeros(10)}
    dcp.load(back, storage_reader=layer.reader(path))
    out: dict[str, Any] = {"replaced": torch.equal(back["random"], t2), "refused": None}
    try:
        dcp.save({"random": t1}, storage_writer=layer.writer(path, overwrite=False))
    except CheckpointException as exc:
        out["refused"] = str(exc)
    back = {"random": torch.zeros(10)}
    dcp.load(back, storage_reader=layer.reader(path))
    out["kept"] = torch.equal(back["random"], t2)
    return out


def sharded_tensors(layer: Any, root: str) -> dict[str, Any]:
    """The ``ShardedTensor`` cases of torch's ``test_file_system_checkpoint.py``: save a 10x20
    tensor sharded by rows, load it sharded by columns and into an uneven enumerable sharding,
    and bytes values beside it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    def uneven() -> EnumerableShardingSpec:
        rows = [(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)]
        return EnumerableShardingSpec(
            [ShardMetadata([r, 0], [n, 20], f"rank:{p}/cpu") for r, n, p in rows]
        )

    def whole(t: Any) -> list[Any] | None:
        full = torch.zeros(10, 20) if dist.get_rank() == 0 else None
        t.gather(out=full)
        return full.tolist() if full is not None else None

    places = [f"rank:{r}/cpu" for r in range(dist.get_world_size())]
    torch.manual_seed(5)
    saved = sharded_tensor.rand(ChunkShardingSpec(dim=0, placements=places), 10, 20)
    path = f"{root}/sharded"
    dcp.save({"st": saved, "b0": [1], "b1": "string"}, storage_writer=layer.writer(path))
    out: dict[str, Any] = {"saved": whole(saved)}
    for name, spec in (("cols", ChunkShardingSpec(dim=1, placements=places)), ("uneven", uneven())):
        target = sharded_tensor.zeros(spec, 10, 20)
        back = {"st": target, "b0": [2], "b1": "other"}
        dcp.load(back, storage_reader=layer.reader(path))
        out[name] = whole(target)
        out[f"{name}_bytes"] = (back["b0"], back["b1"])
    return out


def _case(fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        return fn(*args, **kwargs)
    except (Exception, CheckpointException) as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}


#: every case of :func:`run`, by the name the tests use
CASES: dict[str, tuple[Callable[..., dict[str, Any]], dict[str, Any]]] = {
    "e2e_fsdp": (e2e, {"kind": "fsdp"}),
    "e2e_ddp": (e2e, {"kind": "ddp"}),
    "async_thread": (e2e, {"kind": "fsdp", "save": "thread"}),
    "async_process": (e2e, {"kind": "fsdp", "save": "process"}),
    "async_thread_zoc": (e2e, {"kind": "fsdp", "save": "thread", "zoc": True}),
    "async_process_zoc": (e2e, {"kind": "fsdp", "save": "process", "zoc": True}),
    "partial_load": (partial_load, {}),
    "ordered_keys": (ordered_keys, {}),
    "overwrite": (overwrite, {}),
    "sharded_tensors": (sharded_tensors, {}),
}


def run(root: str, layer_name: str) -> dict[str, Any]:
    """Every case on one layer (each rank; a case's error does not stop the others unless it
    left the group unusable)."""
    import torch.distributed as dist

    from tests.checkpoint.dcp_conformance._layers import Layer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out: dict[str, Any] = {}
    try:
        with Layer(layer_name) as layer:
            for name, (fn, kwargs) in CASES.items():
                out[name] = _case(fn, layer, root, **kwargs)
                dist.barrier()
    finally:
        dist.destroy_process_group()
    return out
