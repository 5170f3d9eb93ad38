"""trainguard.checkpoint.dcp: DCP's save/async_save/load through trainguard's files, writer
process, staging buffers, checksums and commit; resharding 4 -> 3 ranks against DCP's own
file system storage. Multi-rank tests use real ranks (tests/_dist.py), gloo and FSDP2."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from tests._dist import run_ranks
from tests.checkpoint.conftest import no_leaks  # noqa: F401 (fixture)
from trainguard.checkpoint import latest, load
from trainguard.checkpoint.dcp import AsyncStager, StorageReader, StorageWriter
from trainguard.checkpoint.format.read import read_header
from trainguard.errors import (
    CheckpointError,
    CheckpointUncommittedError,
    ConfigError,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 5, generator=g),
        "h": torch.randn(3, generator=g).half(),
        "c": torch.randn(2, generator=g, dtype=torch.complex128),
        "i": torch.arange(7),
        "empty": torch.empty(0, 3),
        "meta": {"step": 12, "name": "run"},
    }


def _zeros_like(state: dict) -> dict:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""}
        for k, v in state.items()
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# ---------------------------------------------------------------------- one process


def test_save_async_save_load_and_nothing_leaks(tmp_path: Path, no_leaks: None) -> None:  # noqa: F811
    state = _state()
    with StorageWriter(tmp_path / "a") as writer, AsyncStager(writer) as stager:
        dcp.save(state, storage_writer=writer)
        future = dcp.async_save(
            state, checkpoint_id=tmp_path / "b", storage_writer=writer, async_stager=stager
        )
        state["w"] += 1  # after async_save returned: must not reach checkpoint b
        future.result()
        assert not writer.last_save_copied  # written from the stager's buffer
        future = dcp.async_save(
            state, checkpoint_id=tmp_path / "c", storage_writer=writer, async_stager=stager
        )
        future.result()
        assert not writer.last_save_copied
        dcp.save(state, checkpoint_id=tmp_path / "d", storage_writer=writer)
        assert writer.last_save_copied  # a synchronous save copies into the writer's buffer
        del future
    for name, expect in (("a", _state()), ("b", _state()), ("c", state)):
        target = _zeros_like(expect)
        dcp.load(target, storage_reader=StorageReader(tmp_path / name))
        _assert_equal(target, expect)
    assert latest(tmp_path) == tmp_path / "d"
    part = load(tmp_path / "c", rank=0)  # trainguard's own loader opens a part by entry
    assert torch.equal(part["w@0,0"], state["w"]) and "meta.step" in part
    gc.collect()
    deadline = time.monotonic() + 10  # DCP's one-shot executor thread ends on its own
    while any(
        t.name.startswith("AsyncCheckpointExecutor") for t in __import__("threading").enumerate()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _saved(tmp_path: Path) -> tuple[dict, Path]:
    """A state saved by dcp.save through our writer, and its one part."""
    state = _state()
    with StorageWriter(tmp_path / "a") as writer:
        dcp.save(state, storage_writer=writer)
    return state, tmp_path / "a" / "rank00000.safetensors"


def test_files_open_as_safetensors(tmp_path: Path) -> None:
    state, file = _saved(tmp_path)
    header = read_header(file)
    assert header.metadata["dcp"] == "1" and "w@0,0" in header.entries
    safetensors = pytest.importorskip("safetensors.torch")
    opened = safetensors.load_file(str(file))
    assert torch.equal(opened["w@0,0"], state["w"])
    assert opened["meta.step"].dtype == torch.uint8  # DCP's pickled bytes items


def test_corrupt_entry_is_named(tmp_path: Path) -> None:
    state, file = _saved(tmp_path)
    header = read_header(file)
    _, _, begin, _ = header.entries["w@0,0"]
    at = header.data_start + begin + 3  # one bit of one element of "w" flips
    fd = os.open(file, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
    finally:
        os.close(fd)
    target = _zeros_like(state)
    with pytest.raises(
        CheckpointException
    ) as info:  # DCP wraps every rank's error (a BaseException)
        dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    text = str(info.value)
    assert "CheckpointCorruptError" in text and "rank00000.safetensors" in text
    assert "checksum mismatch in tensor 'w@0,0'" in text
    # the other entries still load
    del target["w"]
    dcp.load(target, storage_reader=StorageReader(tmp_path / "a"))
    assert torch.equal(target["i"], state["i"])


class _DiesBeforeCommit(StorageWriter):
    """The coordinator dies after every part is durable, before the commit."""

    def finish(self, metadata: object, results: object) -> None:
        raise RuntimeError("coordinator lost before the commit")


def test_latest_skips_uncommitted_and_committed_paths_are_refused(tmp_path: Path) -> None:
    state = _state()
    with StorageWriter(tmp_path / "old", overwrite=False) as writer:
        dcp.save(state, storage_writer=writer)
        with pytest.raises(CheckpointException, match="already a committed checkpoint"):
            dcp.save(state, storage_writer=writer)
    time.sleep(0.01)
    with (
        _DiesBeforeCommit(tmp_path / "new") as writer,
        pytest.raises(CheckpointException, match="lost"),
    ):
        dcp.save(state, storage_writer=writer)
    assert (tmp_path / "new" / "rank00000.safetensors").exists()
    assert latest(tmp_path) == tmp_path / "old"
    with pytest.raises(CheckpointException, match="has no COMMITTED marker"):
        dcp.load(_zeros_like(state), storage_reader=StorageReader(tmp_path / "new"))
    reader = StorageReader(tmp_path / "new")
    with pytest.raises(CheckpointUncommittedError, match="allow_uncommitted"):
        reader.read_metadata()
    with pytest.raises(CheckpointError, match=r"has no \.metadata"):
        StorageReader(tmp_path / "new", allow_uncommitted=True).read_metadata()


class _FailingPlanner(DefaultSavePlanner):
    """A save that fails after the writer was set up, before anything is written."""

    def create_local_plan(self) -> SavePlan:
        raise RuntimeError("planning failed")


def test_stager_buffer_is_reused_only_when_free(tmp_path: Path) -> None:
    state = _state()
    with StorageWriter(tmp_path / "x", overwrite=False) as writer:
        dcp.save(state, checkpoint_id=tmp_path / "done", storage_writer=writer)
        with AsyncStager(writer, busy_timeout=0.3) as stager:
            stager.stage(state)  # never saved: the buffer stays reserved for its save
            with pytest.raises(CheckpointError, match="busy_timeout"):
                stager.stage(state)
        writer._release_staged()
        with AsyncStager(writer, busy_timeout=60) as stager:
            # saves that fail before they write (a committed path; a planning error) free it
            for path, planner in ((tmp_path / "done", None), (tmp_path / "p", _FailingPlanner())):
                started = time.monotonic()
                future = dcp.async_save(
                    state,
                    checkpoint_id=path,
                    storage_writer=writer,
                    async_stager=stager,
                    planner=planner,
                )
                with pytest.raises(CheckpointException, match=r"already a committed|planning"):
                    future.result()
                assert time.monotonic() - started < 30
            future = dcp.async_save(
                state, checkpoint_id=tmp_path / "next", storage_writer=writer, async_stager=stager
            )
            future.result()
    target = _zeros_like(state)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "next"))
    _assert_equal(target, state)


def test_bad_arguments_fail_at_construction(tmp_path: Path) -> None:
    for bad in (3, None, b"dir", ""):
        with pytest.raises(ConfigError, match=r"str or os\.PathLike|non-empty"):
            StorageWriter(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"str or os\.PathLike|non-empty"):
            StorageReader(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="start_timeout"):
        StorageWriter(tmp_path, start_timeout=-1)
    with pytest.raises(ConfigError, match="writer_nice"):
        StorageWriter(tmp_path, writer_nice=40)
    with pytest.raises(ConfigError, match="StorageWriter"):
        AsyncStager(dcp.FileSystemWriter(str(tmp_path)))  # type: ignore[arg-type]
    with StorageWriter(tmp_path) as writer:
        with pytest.raises(ConfigError, match="busy_timeout"):
            AsyncStager(writer, busy_timeout=0)
        with pytest.raises(ConfigError, match="checkpoint_id"):
            writer.reset(checkpoint_id=42)  # type: ignore[arg-type]
    with pytest.raises(CheckpointException, match="StorageWriter is closed"):
        dcp.save(_state(), storage_writer=writer)


# ---------------------------------------------------------------------- FSDP2, real ranks


def _fsdp(world: int, seed: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(state):
    """Every leaf of a (nested) state as a full plain tensor or value, in a flat dict."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k in node:
                walk(node[k], f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, DTensor):
            out[path] = node.full_tensor()
        elif isinstance(node, torch.Tensor):
            out[path] = node.clone()
        else:
            out[path] = node

    walk(state, "")
    return out


def _pack(value: object) -> bytes:
    """Tensors cross the result pipe of tests/_dist.py as bytes (a rank that exits at once
    cannot hand over shared memory)."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(raw: bytes) -> dict:
    import io

    return torch.load(io.BytesIO(raw), weights_only=True)


def _saver(root: str) -> dict:
    """4 ranks: one FSDP2 state saved by dcp.save through trainguard and through DCP's own
    FileSystemWriter; one more step, then dcp.async_save through our stager; both loaded
    back into fresh models."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp(4, seed=0)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    first = _full({"model": msd, "optim": osd})
    with StorageWriter(f"{root}/ours") as writer, AsyncStager(writer) as stager:
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp")  # DCP's own
        _train(model, opt, 1)
        msd, osd = get_state_dict(model, opt)
        second = _full({"model": msd, "optim": osd})
        ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives, apart from
        started = time.monotonic()  # training's (as torchtitan does)
        future = dcp.async_save(
            {"model": msd, "optim": osd},
            checkpoint_id=f"{root}/async",
            storage_writer=writer,
            async_stager=stager,
            process_group=ckpt_group,
        )
        stall = time.monotonic() - started
        _train(model, opt, 1)  # training goes on while the writer works
        future.result()
        copied = writer.last_save_copied
    loaded = {}
    for name in ("ours", "async"):
        fresh, fresh_opt = _fsdp(4, seed=7)
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=StorageReader(f"{root}/{name}"))
        set_state_dict(
            fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        loaded[name] = _full(
            dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt), strict=True))
        )
    dist.barrier()
    if dist.get_rank() != 0:
        return {"stall": stall, "copied": copied}
    full = {"first": first, "second": second, "loaded": loaded}
    return {
        "copied": copied,
        "full": _pack(full),
        "stall": stall,
        "stage": stager.last_stage_seconds,
    }


def _resharder(root: str) -> dict:
    """3 ranks: load the 4-rank checkpoint through our reader and DCP's saved copy through
    DCP's FileSystemReader; both into fresh 3-rank FSDP2 models."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for name, reader in (
        ("ours", StorageReader(f"{root}/ours")),
        ("dcp", dcp.FileSystemReader(f"{root}/dcp")),
    ):
        model, opt = _fsdp(3, seed=11)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[name] = _full(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
        if name == "ours":
            bytes_read = reader.bytes_read
    return {"full": _pack(out), "bytes_read": bytes_read}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("dcp4")
    results = [r.get() for r in run_ranks(_saver, 4, args=(str(root),), timeout=150)]
    results[0].update(_unpack(results[0].pop("full")))
    return root, results


def test_fsdp2_round_trip_4_ranks_bit_exact(saved: tuple[Path, list[dict]]) -> None:
    root, results = saved
    r0 = results[0]
    _assert_equal(r0["loaded"]["ours"], r0["first"])
    assert sorted(os.listdir(root / "ours")) == [
        ".metadata",
        "COMMITTED",
        *(f"rank{r:05d}.safetensors" for r in range(4)),
    ]
    assert latest(root) in {root / "ours", root / "async"}


def test_fsdp2_async_save_through_our_stager(saved: tuple[Path, list[dict]]) -> None:
    _, results = saved
    r0 = results[0]
    _assert_equal(r0["loaded"]["async"], r0["second"])  # not the step after async_save
    assert not any(r["copied"] for r in results)  # written from the staged buffer
    print(
        f"async_save stall per rank: {[round(r['stall'] * 1e3, 1) for r in results]} ms, "
        f"of which staging {r0['stage'] * 1e3:.1f} ms"
    )


def test_reshard_4_to_3_equals_dcp(saved: tuple[Path, list[dict]]) -> None:
    root, results = saved
    out = [r.get() for r in run_ranks(_resharder, 3, args=(str(root),), timeout=150)]
    for rank in out:
        rank.update(_unpack(rank.pop("full")))
        _assert_equal(rank["ours"], rank["dcp"])
        _assert_equal(rank["ours"], results[0]["first"])
    total = sum(os.path.getsize(root / "ours" / f"rank{r:05d}.safetensors") for r in range(4))
    assert all(0 < r["bytes_read"] < total for r in out), [r["bytes_read"] for r in out]
