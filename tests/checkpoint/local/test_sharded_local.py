"""Sharded state (FSDP2 model + Adam) in local checkpoints, loaded with ``load(it, into=...)``.

Real ranks (gloo, TCPStore) through tests/_dist.py, 2 "nodes" of 2 (TRAINGUARD_HOST_NAME node0,
node1) and CliqueReplication(2) by host: the cliques of 4 ranks are {0, 2} and {1, 3}. One save phase (4 ranks: an
FSDP2 model trained one Adam step, saved as iteration 1 and with ``dcp.save``) builds the roots
once for the module; each later test works on a copy. Every load fills a target whose values
were set to NaN first, and is compared with ``torch.equal`` against what ``dcp.load`` gives for
the same target (the reference for resharding) or against the live state.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from trainguard.events import read_events

ENV = {"LOCAL_WORLD_SIZE": "2"}


def on_node(rank: int) -> dict[str, str]:
    """Ranks 0 1 on "node0", 2 3 on "node1" (the host each reports for placing copies)."""
    return {"TRAINGUARD_HOST_NAME": f"node{rank // 2}"}


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

    from trainguard.checkpoint.format.read import read_header

    rank = _init()
    try:
        state = _trained()
        with _manager(roots[rank]) as mgr:
            for it in (1, 2):
                mgr.save({**state, "step": it}, it)
            mgr.wait()
            dcp.save({k: state[k] for k in ("model", "optim")}, checkpoint_id=dcp_dir)
            target = _target()
            assert mgr.find_latest() == 2
            loaded = mgr.load(2, into=target)
            state["step"] = 2
            own = _part(roots[rank], 2, rank, rank)
            header = read_header(own)
            return {
                "same_object": loaded is target,
                "differences": _differences(target, state),
                "last_load": mgr.last_load,
                "data_bytes": sum(e - b for _, _, b, e in header.entries.values()),
            }
    finally:
        dist.destroy_process_group()


def _part(root: str, iteration: int, owner: int, holder: int) -> Path:
    return Path(root, f"iter_{iteration:012d}", f"owner{owner:05d}.h{holder:05d}.safetensors")


def _rot(path: Path) -> None:
    """Flip a byte in the middle of the data, keeping size, inode and modification time: a
    copy that went bad after it was verified (the scan does not hash it again)."""
    from trainguard.checkpoint.format.read import read_header

    header, st = read_header(path), path.stat()
    with open(path, "r+b") as f:
        f.seek(header.data_start + (header.file_size - header.data_start) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _load_phase(
    roots: list[str],
    dcp_dir: str,
    events_dir: str,
    save_to: str | None = None,
    rot: dict[int, list[tuple[int, int]]] | None = None,
    plain_first: bool = False,
) -> dict:
    """find_latest + load(into=NaN target), compared with dcp.load of the same target. With
    ``save_to``, the loaded state is saved again as the next iteration (and with dcp.save
    there). ``rot``: rank -> [(iteration, owner)] of its copies to damage after find_latest.
    ``plain_first``: try load() without ``into`` first and return its error."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainguard import events
    from trainguard.errors import CheckpointError

    rank = _init()
    events.configure(events_dir, rank=rank)
    plain_error = None
    try:
        with _manager(roots[rank]) as mgr:
            latest = mgr.find_latest()
            if plain_first:
                try:
                    mgr.load(latest)
                except CheckpointError as exc:
                    plain_error = (type(exc).__name__, str(exc))
            for it, owner in (rot or {}).get(rank, []):
                _rot(_part(roots[rank], it, owner, rank))
            dist.barrier()
            target = _target()
            mgr.load(latest, into=target)
            reference = _target()
            dcp.load({k: reference[k] for k in ("model", "optim")}, checkpoint_id=dcp_dir)
            reference["step"] = mgr.last_load["iteration"]  # dcp saved model and optim only
            out = {
                "latest": latest,
                "differences": _differences(target, reference),
                "last_load": mgr.last_load,
                "plain_error": plain_error,
            }
            if save_to is not None:
                target["step"] = latest + 1
                mgr.save(target, latest + 1)
                mgr.wait()
                dcp.save({k: target[k] for k in ("model", "optim")}, checkpoint_id=save_to)
            return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    base = tmp_path_factory.mktemp("sharded")
    roots = [str(base / f"rank{r}") for r in range(4)]
    results = run_ranks(
        _save_phase, 4, args=(roots, str(base / "dcp")), env=ENV, rank_env=on_node, timeout=150
    )
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
        assert last["iteration"] == 2 and last["source"] == "local", last
        assert last["bytes_received"] == 0 and last["parts"] == [rank], last
        # every chunk of its own part (its shards and its plain tensors), nothing else
        assert last["bytes_local"] == last["bytes"] == out["data_bytes"] > 0, (last, out)


def test_lost_copy_chunks_come_from_the_peer_and_plain_load_names_into(
    saved: tuple[Path, list[dict]], tmp_path
) -> None:
    base, _ = saved
    roots = _copy(base, tmp_path, range(4))
    shutil.rmtree(roots[1])  # rank 1's node is gone with its root; its part lives on rank 3
    results = run_ranks(
        _load_phase,
        4,
        args=(roots, str(base / "dcp"), str(tmp_path / "events")),
        kwargs={"plain_first": True},
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    outs = [r.get() for r in results]
    for rank, out in enumerate(outs):
        assert out["latest"] == 2 and out["differences"] == [], (rank, out)
        # without into=, a part holding DTensors is refused, naming the fix
        name, text = out["plain_error"]
        assert name == "CheckpointError" and "into=" in text and "DTensor" in text, text
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
    """Rank 3 died with its root: 3 ranks load the 4-rank iteration 2 (owner 3's part from
    its peer's copy on rank 1), then save what they loaded as iteration 3 (and with dcp.save)."""
    base, _ = saved
    here = tmp_path_factory.mktemp("shrunk")
    roots = _copy(base, here, range(3))
    results = run_ranks(
        _load_phase,
        3,
        args=(roots, str(base / "dcp"), str(here / "events"), str(here / "dcp")),
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    return here, roots, [r.get() for r in results]


def test_reshard_4_to_3_equals_dcp(shrunk: tuple) -> None:
    _, _, outs = shrunk
    for rank, out in enumerate(outs):
        assert out["latest"] == 2 and out["differences"] == [], (rank, out)
    # rank 2 now holds row 6 of the 7-row tensors, saved by rank 3: its copy is on rank 1
    last = outs[2]["last_load"]
    assert 3 in last["parts"] and last["source"] == "local + ranks 1", last
    assert last["bytes_received"] > 0 and last["bytes_local"] > 0, last


def test_reshard_3_to_4_equals_dcp(shrunk: tuple, tmp_path: Path) -> None:
    """Growing back: 4 ranks, rank 3 on a new empty root, load the 3-rank iteration 3."""
    here, roots, _ = shrunk
    roots = [*roots, str(tmp_path / "rank3-new")]
    results = run_ranks(
        _load_phase,
        4,
        args=(roots, str(here / "dcp"), str(tmp_path / "events")),
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    outs = [r.get() for r in results]
    for rank, out in enumerate(outs):
        assert out["latest"] == 3 and out["differences"] == [], (rank, out)
    new = outs[3]["last_load"]
    assert new["bytes_local"] == 0 and new["bytes_received"] == new["bytes"] > 0, new
    assert new["source"].startswith("ranks "), new


def test_bad_copies_found_while_loading_another_holder_then_older_iteration(
    saved: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """Rank 1's root is gone. After find_latest verified every copy, rank 3's copy of owner
    1's part of iteration 2 and rank 0's own part of iteration 1 go bad unseen. Attempt 1:
    rank 1 receives owner 1's chunks from rank 3, their checksums fail; attempt 2: no good
    copy of that part is left, so iteration 1 is loaded instead (with a warning), and rank 0's
    own chunks fail their checksums; attempt 3: rank 0 receives them from rank 2."""
    base, _ = saved
    roots = _copy(base, tmp_path, range(4))
    shutil.rmtree(roots[1])
    rot = {3: [(2, 1)], 0: [(1, 0)]}
    results = run_ranks(
        _load_phase,
        4,
        args=(roots, str(base / "dcp"), str(tmp_path / "events")),
        kwargs={"rot": rot},
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    outs = [r.get() for r in results]
    for rank, out in enumerate(outs):
        assert out["latest"] == 2 and out["differences"] == [], (rank, out)
        assert out["last_load"]["iteration"] == 1, out
    assert outs[0]["last_load"]["source"] == "ranks 2", outs[0]
    assert outs[1]["last_load"]["source"] == "ranks 3", outs[1]
    events = read_events(tmp_path / "events")
    loads = [e for e in events if e["kind"] == "local_ckpt_load"]
    assert len(loads) == 4 and all(e["attempts"] == 3 and e["requested"] == 2 for e in loads)
    fallback = [e for e in events if e["kind"] == "local_ckpt_fallback"]
    assert fallback and "owner(s) [1]" in fallback[0]["reason"], fallback


def test_plan_spreads_ranges_over_holders_and_never_sends_to_self() -> None:
    from trainguard.checkpoint.local._reshard_load import plan_ranges

    needs = {0: [], 1: [[0, 10, 110], [2, 0, 50]], 3: [[0, 110, 120], [2, 50, 60]]}
    holders = {0: [0, 2], 2: [0, 2, 3]}
    assert plan_ranges(needs, holders) == [
        (0, 10, 110, 0, 1),
        (2, 0, 50, 2, 1),  # rank 0 has 100 bytes to send already
        (0, 110, 120, 2, 3),  # rank 2 has 50 bytes to send, rank 0 100
        (2, 50, 60, 2, 3),  # rank 2 has 60, rank 0 100; rank 3 (0) never sends to itself
    ]
