"""Sharded state (FSDP2 model + Adam) in local checkpoints, loaded with ``load(it, into=...)``.

Real ranks (gloo, TCPStore) through tests/_dist.py, 2 "nodes" of 2 (LOCAL_WORLD_SIZE=2) and
CliqueReplication(2): the cliques of 4 ranks are {0, 2} and {1, 3}. One save phase (4 ranks: an
FSDP2 model trained one Adam step, saved as iteration 1 and with ``dcp.save``) builds the roots
once for the module; each later test works on a copy. Every load fills a target whose values
were set to NaN first, and is compared with ``torch.equal`` against what ``dcp.load`` gives for
the same target (the reference for resharding) or against the live state.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from trainguard.events import read_events

ENV = {"LOCAL_WORLD_SIZE": "2"}


def _init() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.get_rank()


def _model_and_optim() -> tuple[Any, Any]:
    """Rows 7 and 5 shard unevenly over 3 and 4 ranks (a rank may hold no row at all)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _state(model: Any, opt: Any, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def _trained() -> dict:
    import torch
    import torch.distributed as dist

    model, opt = _model_and_optim()
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 16, generator=g)
    model(x).square().sum().backward()
    opt.step()
    return _state(model, opt, 1)


def _target() -> dict:
    """A fresh model and optimizer of this world, every tensor value set to NaN."""
    import torch

    state = _state(*_model_and_optim(), 0)
    for _, t in _leaves(state):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            _local(t).fill_(float("nan"))
    return state


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _leaves(state: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(state, dict):
        return [x for k in sorted(state, key=str) for x in _leaves(state[k], (*path, k))]
    if isinstance(state, (list, tuple)):
        return [x for i, v in enumerate(state) for x in _leaves(v, (*path, i))]
    return [(path, state)]


def _differences(got: Any, want: Any) -> list[str]:
    """Leaves that differ (local shards compared with torch.equal, dtypes too)."""
    import torch

    a, b = dict(_leaves(got)), dict(_leaves(want))
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(map(str, a.keys() ^ b.keys()))}"]
    out = []
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            same = (
                isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and torch.equal(_local(x), _local(y))
            )
        else:
            same = x == y
        if not same:
            out.append(str(key))
    return out


def _manager(root: str, **kw: Any) -> Any:
    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

    kw.setdefault("replication", CliqueReplication(factor=2))
    return LocalCheckpointManager(root, timeout=60, **kw)


def _save_phase(roots: list[str], dcp_dir: str) -> dict:
    """Save iteration 1 and a DCP checkpoint; then load it into a fresh target of the same
    sharding and compare with the live state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint.fileformat import read_header

    rank = _init()
    try:
        state = _trained()
        with _manager(roots[rank]) as mgr:
            mgr.save(state, 1)
            mgr.wait()
            dcp.save({k: state[k] for k in ("model", "optim")}, checkpoint_id=dcp_dir)
            target = _target()
            assert mgr.find_latest() == 1
            loaded = mgr.load(1, into=target)
            own = Path(roots[rank], "iter_000000000001", f"owner{rank:05d}.h{rank:05d}.safetensors")
            header = read_header(own)
            return {
                "same_object": loaded is target,
                "differences": _differences(target, state),
                "last_load": mgr.last_load,
                "data_bytes": sum(e - b for _, _, b, e in header.entries.values()),
            }
    finally:
        dist.destroy_process_group()


def _load_phase(roots: list[str], dcp_dir: str, events_dir: str, save_to: str | None) -> dict:
    """find_latest + load(into=NaN target), compared with dcp.load of the same target; with
    ``save_to``, the loaded state is saved again (iteration 2, and with dcp.save there)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainguard import events

    rank = _init()
    events.configure(events_dir, rank=rank)
    try:
        with _manager(roots[rank]) as mgr:
            latest = mgr.find_latest()
            target = _target()
            mgr.load(latest, into=target)
            reference = _target()
            dcp.load({k: reference[k] for k in ("model", "optim")}, checkpoint_id=dcp_dir)
            reference["step"] = 1  # dcp saved model and optim only
            out = {
                "latest": latest,
                "differences": _differences(target, reference),
                "last_load": mgr.last_load,
            }
            if save_to is not None:
                mgr.save(target, 2)
                mgr.wait()
                dcp.save({k: target[k] for k in ("model", "optim")}, checkpoint_id=save_to)
            return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    base = tmp_path_factory.mktemp("sharded")
    roots = [str(base / f"rank{r}") for r in range(4)]
    results = run_ranks(_save_phase, 4, args=(roots, str(base / "dcp")), env=ENV, timeout=150)
    return base, [r.get() for r in results]


def _copy(base: Path, tmp_path: Path, ranks: range) -> list[str]:
    roots = []
    for r in ranks:
        shutil.copytree(base / f"rank{r}", tmp_path / f"rank{r}")
        roots.append(str(tmp_path / f"rank{r}"))
    return roots


def test_same_sharding_loads_bit_exact_reading_only_own_part(
    saved: tuple[Path, list[dict]],
) -> None:
    _, results = saved
    for rank, out in enumerate(results):
        assert out["same_object"] and out["differences"] == [], (rank, out)
        last = out["last_load"]
        assert last["iteration"] == 1 and last["source"] == "local", last
        assert last["bytes_received"] == 0 and last["parts"] == [rank], last
        # every chunk of its own part (its shards and its plain tensors), nothing else
        assert last["bytes_local"] == last["bytes"] == out["data_bytes"] > 0, (last, out)


def test_lost_copy_chunks_come_from_the_peer(saved: tuple[Path, list[dict]], tmp_path) -> None:
    base, _ = saved
    roots = _copy(base, tmp_path, range(4))
    shutil.rmtree(roots[1])  # rank 1's node is gone with its root; its part lives on rank 3
    results = run_ranks(
        _load_phase,
        4,
        args=(roots, str(base / "dcp"), str(tmp_path / "events"), None),
        env=ENV,
        timeout=150,
    )
    outs = [r.get() for r in results]
    for rank, out in enumerate(outs):
        assert out["latest"] == 1 and out["differences"] == [], (rank, out)
    lost = outs[1]["last_load"]
    assert lost["source"] == "ranks 3" and lost["bytes_local"] == 0, lost
    assert lost["bytes_received"] == lost["bytes"] > 0, lost
    for rank in (0, 2, 3):
        last = outs[rank]["last_load"]
        assert last["source"] == "local" and last["bytes_received"] == 0, last
    loads = [e for e in read_events(tmp_path / "events") if e["kind"] == "local_ckpt_load"]
    by_rank = {e["rank"]: e for e in loads}
    assert by_rank[1]["bytes_received"] == lost["bytes_received"] and by_rank[1]["attempts"] == 1


@pytest.fixture(scope="module")
def shrunk(saved: tuple[Path, list[dict]], tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """Rank 3 died with its root: 3 ranks load the 4-rank iteration 1 (owner 3's part from
    its peer's copy on rank 1), then save what they loaded as iteration 2 (and with dcp.save)."""
    base, _ = saved
    here = tmp_path_factory.mktemp("shrunk")
    roots = _copy(base, here, range(3))
    results = run_ranks(
        _load_phase,
        3,
        args=(roots, str(base / "dcp"), str(here / "events"), str(here / "dcp")),
        env=ENV,
        timeout=150,
    )
    return here, roots, [r.get() for r in results]


def test_reshard_4_to_3_equals_dcp(shrunk: tuple) -> None:
    _, _, outs = shrunk
    for rank, out in enumerate(outs):
        assert out["latest"] == 1 and out["differences"] == [], (rank, out)
    # rank 2 now holds row 6 of the 7-row tensors, saved by rank 3: its copy is on rank 1
    last = outs[2]["last_load"]
    assert 3 in last["parts"] and last["source"] == "local + ranks 1", last
    assert last["bytes_received"] > 0 and last["bytes_local"] > 0, last


def test_reshard_3_to_4_equals_dcp(shrunk: tuple, tmp_path: Path) -> None:
    """Growing back: 4 ranks, rank 3 on a new empty root, load the 3-rank iteration 2."""
    here, roots, _ = shrunk
    roots = [*roots, str(tmp_path / "rank3-new")]
    results = run_ranks(
        _load_phase,
        4,
        args=(roots, str(here / "dcp"), str(tmp_path / "events"), None),
        env=ENV,
        timeout=150,
    )
    outs = [r.get() for r in results]
    for rank, out in enumerate(outs):
        assert out["latest"] == 2 and out["differences"] == [], (rank, out)
    new = outs[3]["last_load"]
    assert new["bytes_local"] == 0 and new["bytes_received"] == new["bytes"] > 0, new
    assert new["source"].startswith("ranks "), new
