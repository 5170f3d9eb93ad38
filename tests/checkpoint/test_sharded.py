"""Sharded state (FSDP2, DTensor) through AsyncCheckpointer and load(path, into=), on real
ranks (gloo, tests/_dist.py): bit-exact round trips, replicas written once, resharding
4 -> 3 -> 4 ranks equal to torch.distributed.checkpoint's result, a corrupt chunk named (and
never read by ranks that do not need it), and a single process consolidating a checkpoint."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks

ROWS, COLS = 7, 6  # uneven over 2, 3 and 4 ranks


def _setup() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    return dist


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _fsdp(seed: int, train: bool, mesh: Any = None) -> tuple[Any, Any]:
    """A small FSDP2 model (uneven rows) and Adam; ``train`` takes one step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = mesh or _mesh((torch.distributed.get_world_size(),))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(COLS, ROWS), torch.nn.Linear(ROWS, 5))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if train:
        x = torch.randn(4, COLS, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)  # a fresh optimizer's state is initialized here
    return model, {"model": msd, "optim": osd, "epoch": seed}


def _tensors(state: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor leaf (a DTensor's local shard) by path."""
    from trainguard.checkpoint.format.shards import local_view

    if isinstance(state, torch.Tensor):
        return {path: local_view(state)}
    out: dict[tuple[Any, ...], torch.Tensor] = {}
    if isinstance(state, (dict, list, tuple)):
        for k, v in state.items() if isinstance(state, dict) else enumerate(state):
            out.update(_tensors(v, (*path, k)))
    return out


def _same(a: Any, b: Any) -> list[str]:
    """Paths where two states differ (tensors with torch.equal, other leaves with ==)."""
    ta, tb = _tensors(a), _tensors(b)
    bad = [str(k) for k in ta if k not in tb or not torch.equal(ta[k], tb[k])]
    bad += [str(k) for k in tb if k not in ta]
    return bad


def _plain(state: Any) -> Any:
    """The state without its tensors (what == compares)."""
    if isinstance(state, torch.Tensor):
        return None
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    return state


def _save(state: Any, path: str) -> None:
    from trainguard.checkpoint import AsyncCheckpointer

    with AsyncCheckpointer(commit_timeout=60) as ckpt:
        ckpt.save(state, path)
        ckpt.wait()


def _load_events(events_dir: str) -> list[dict[str, Any]]:
    from trainguard import events

    return [e for e in events.read_events(events_dir) if e["kind"] == "ckpt_load"]


# ---------------------------------------------------------------- FSDP2 round trip, corruption


def _fsdp_round_trip(root: str) -> dict[str, Any]:
    from trainguard import events
    from trainguard.checkpoint import load
    from trainguard.checkpoint._reshard import Index
    from trainguard.checkpoint.format.read import read_header
    from trainguard.errors import CheckpointCorruptError

    dist = _setup()
    rank = dist.get_rank()
    events.configure(f"{root}/events{rank}", rank=rank)
    out: dict[str, Any] = {}
    try:
        _, saved = _fsdp(1, train=True)
        _save(saved, f"{root}/ckpt")
        model, target = _fsdp(2, train=False)
        assert load(f"{root}/ckpt", into=target) is target
        out["diff"] = _same(saved, target)
        out["model_diff"] = _same(saved["model"], model.state_dict())  # filled in place
        out["plain_equal"] = _plain(saved) == _plain(target)
        own = read_header(f"{root}/ckpt/rank{rank:05d}.safetensors")
        out["own_bytes"] = sum(e - b for _, _, b, e in own.entries.values())
        (event,) = _load_events(f"{root}/events{rank}")
        out["event"] = (event["bytes"], event["parts"])
        dist.barrier()
        if rank == 0:  # flip one byte of rank 1's chunk of the first weight
            path = f"{root}/ckpt/rank00001.safetensors"
            header = read_header(path)
            _, _, begin, _ = header.entries["model.0.weight"]
            with open(path, "r+b") as f:
                f.seek(header.data_start + begin)
                byte = f.read(1)
                f.seek(header.data_start + begin)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        _, again = _fsdp(3, train=False)
        headers = {r: read_header(f"{root}/ckpt/rank{r:05d}.safetensors") for r in range(4)}
        needed = Index.from_headers(headers).needed(again, plain_part=rank)
        out["needs_bad_chunk"] = any(c.part == 1 and c.entry == "model.0.weight" for c in needed)
        try:
            load(f"{root}/ckpt", into=again)
            out["after_corruption"] = _same(saved, again)
        except CheckpointCorruptError as exc:
            out["after_corruption"] = str(exc)
    finally:
        dist.destroy_process_group()
    return out


def test_fsdp2_round_trip_reads_own_chunks_and_names_a_corrupt_chunk(tmp_path: Path) -> None:
    results = [r.get() for r in run_ranks(_fsdp_round_trip, 4, args=(str(tmp_path),), timeout=120)]
    for rank, out in enumerate(results):
        assert out["diff"] == out["model_diff"] == [] and out["plain_equal"], (rank, out)
        # the same sharding: each rank reads exactly the bytes of its own part, nothing else
        assert out["event"] == (out["own_bytes"], [rank]), (rank, out)
        if rank == 1:
            assert out["needs_bad_chunk"]
            message = out["after_corruption"]
            assert isinstance(message, str), message
            assert "rank00001.safetensors: checksum mismatch in chunk of " in message
            assert "state['model']['0.weight'] at offsets (2, 0) sizes (2, 6)" in message
        else:  # their targets do not overlap that chunk: never read, loaded fine
            assert not out["needs_bad_chunk"]
            assert out["after_corruption"] == [], (rank, out)


# ---------------------------------------------------------------- 2-D DTensor state


def _full(seed: int, shape: tuple[int, ...] = (ROWS, COLS)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _two_d(mesh: Any, layout: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {
        "saved": ([Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Replicate()]),
        "other": ([Shard(1), Shard(0)], [Replicate(), Shard(0)], [Shard(0), Shard(1)]),
    }[layout]
    return {
        name: distribute_tensor(
            _full(seed) if layout == "saved" else torch.zeros(ROWS, COLS), mesh, p
        )
        for seed, (name, p) in enumerate(zip("abc", placements, strict=True))
    } | {"step": 5}


def _two_d_round_trip(root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial

    from trainguard.checkpoint import AsyncCheckpointer, load
    from trainguard.errors import CheckpointError, ConfigError

    dist = _setup()
    out: dict[str, Any] = {}
    try:
        mesh = _mesh((2, 2))
        saved = _two_d(mesh, "saved")
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial(), Partial()])
        with AsyncCheckpointer(commit_timeout=60) as ckpt:
            with pytest.raises(CheckpointError, match=r"state\['grad'\].*Partial.*redistribute"):
                ckpt.save({"grad": partial}, f"{root}/partial")
            with pytest.raises(ConfigError, match='format="trainguard"'):
                ckpt.save(saved, f"{root}/torch", format="torch")
            ckpt.save(saved, f"{root}/ckpt")
            ckpt.wait()
        same = _two_d(mesh, "saved")
        for t in _tensors(same).values():
            t.zero_()
        load(f"{root}/ckpt", into=same)
        out["same"] = _same(saved, same) + ([] if same["step"] == 5 else ["step"])
        other = _two_d(mesh, "other")
        load(f"{root}/ckpt", into=other)
        out["other"] = [
            k for k in "abc" if not torch.equal(other[k].full_tensor(), _full("abc".index(k)))
        ]
    finally:
        dist.destroy_process_group()
    return out


def test_two_d_dtensor_round_trip_writes_replicas_once(tmp_path: Path) -> None:
    from trainguard.checkpoint import load
    from trainguard.checkpoint.format.read import read_header
    from trainguard.errors import CheckpointError

    results = [r.get() for r in run_ranks(_two_d_round_trip, 4, args=(str(tmp_path),), timeout=120)]
    for rank, out in enumerate(results):
        assert out == {"same": [], "other": []}, (rank, out)
    ckpt = tmp_path / "ckpt"
    holders = {
        name: [
            r for r in range(4) if name in read_header(ckpt / f"rank{r:05d}.safetensors").entries
        ]
        for name in "abc"
    }
    # rank = 2 * row + column of the (2, 2) mesh; a replica is written by coordinate 0 only
    assert holders == {"a": [0, 1, 2, 3], "b": [0, 2], "c": [0]}
    # one process consolidates the sharded checkpoint into full plain tensors
    full = load(ckpt, into={k: torch.empty(ROWS, COLS) for k in "abc"})
    for seed, k in enumerate("abc"):
        assert torch.equal(full[k], _full(seed)), k
    with pytest.raises(CheckpointError, match=r"load\(path, into=target_state\)"):
        load(ckpt, rank=1)


# ---------------------------------------------------------------- resharding 4 -> 3 -> 4 vs DCP


def _compare_load(root: str, source: str, mesh: Any, group: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Load ours-<source> and DCP's dcp-<source> into fresh FSDP2 targets on ``mesh``."""
    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint import load
    from trainguard.checkpoint._reshard import Index
    from trainguard.checkpoint.format.read import read_header

    rank = torch.distributed.get_rank()
    _, ours = _fsdp(2, train=False, mesh=mesh)
    _, theirs = _fsdp(3, train=False, mesh=mesh)
    folder = f"{root}/ours-{source}"
    headers = {
        int(n[4:9]): read_header(f"{folder}/{n}") for n in os.listdir(folder) if n[:4] == "rank"
    }
    needed = Index.from_headers(headers).needed(ours, plain_part=rank if rank in headers else 0)
    load(folder, into=ours)
    dcp.load(theirs, checkpoint_id=f"{root}/dcp-{source}", process_group=group)
    (event,) = [e for e in _load_events(f"{root}/events{rank}") if e["path"] == folder]
    data = sum(e - b for h in headers.values() for _, _, b, e in h.entries.values())
    return (
        ours,
        theirs,
        {
            "diff": _same(ours, theirs),
            "plain_equal": _plain(ours) == _plain(theirs),
            "bytes": (event["bytes"], sum(c.nbytes for c in needed), data),
        },
    )


def _reshard_4_3_4(root: str) -> dict[str, Any]:
    """4 ranks save; ranks 0-2 (a 3-rank mesh) load it, and save; all 4 load that: ours and
    DCP's side by side at every step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    from trainguard import events
    from trainguard.checkpoint import AsyncCheckpointer

    dist = _setup()
    rank = dist.get_rank()
    events.configure(f"{root}/events{rank}", rank=rank)
    out: dict[str, Any] = {}
    try:
        three = dist.new_group([0, 1, 2])
        _, original = _fsdp(1, train=True)
        _save(original, f"{root}/ours-4")
        dcp.save(original, checkpoint_id=f"{root}/dcp-4")
        if rank < 3:
            mesh3 = DeviceMesh.from_group(three, "cpu")
            ours, theirs, out["3"] = _compare_load(root, "4", mesh3, three)
            store = dist.PrefixStore("three", dist.distributed_c10d._get_default_store())
            with AsyncCheckpointer(store=store, rank=rank, world_size=3) as ckpt:
                ckpt.save(ours, f"{root}/ours-3")
                ckpt.wait()
            dcp.save(theirs, checkpoint_id=f"{root}/dcp-3", process_group=three)
        dist.barrier()
        ours, _, out["4"] = _compare_load(root, "3", None, None)
        out["vs_original"] = _same(original, ours)
    finally:
        dist.destroy_process_group()
    return out


def test_reshard_4_to_3_to_4_equals_dcp(tmp_path: Path) -> None:
    results = [r.get() for r in run_ranks(_reshard_4_3_4, 4, args=(str(tmp_path),), timeout=150)]
    for rank, out in enumerate(results):
        for step in ("3", "4") if rank < 3 else ("4",):
            assert out[step]["diff"] == [] and out[step]["plain_equal"], (step, rank, out)
            read, needed, data = out[step]["bytes"]
            assert read == needed < data, (step, rank, out)  # overlapping chunks only
        assert out["vs_original"] == [], (rank, out)
