"""How trainguard's DCP storage layer meets the rest of DCP: URL checkpoint ids go to other
layers, DCP's own file layout is named as such, a writer works in a daemonic process, and
``dcp.async_save`` with the PROCESS executor works (or is refused at once with our stager)."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests._dist import run_ranks
from trainguard.checkpoint.dcp import StorageReader, StorageWriter
from trainguard.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(24.0).reshape(4, 6), "b": torch.tensor([1, 2, 3])}


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    target = {"w": torch.zeros(4, 6), "b": torch.zeros(3, dtype=torch.int64)}
    dcp.load(target, storage_reader=StorageReader(path))
    return target


def test_url_checkpoint_ids_are_left_to_other_storage_layers(tmp_path: Path) -> None:
    for layer in (StorageWriter, StorageReader):
        for bad in ("abc://abc.abc", "s3://bucket/key", "file:///tmp/x", "", 3, b"dir", None):
            assert layer.validate_checkpoint_id(bad) is False, (layer, bad)  # type: ignore[arg-type]
        assert layer.validate_checkpoint_id(str(tmp_path / "a")) is True
        assert layer.validate_checkpoint_id(tmp_path / "a") is True
    with pytest.raises(ConfigError, match="not a local directory"):
        StorageWriter("s3://bucket/key")
    with StorageWriter(tmp_path / "x") as writer, pytest.raises(ConfigError, match="local"):
        dcp.save(_state(), checkpoint_id="abc://abc.abc", storage_writer=writer)
    assert not (Path.cwd() / "abc:").exists()


def test_reader_names_dcps_own_file_layout(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")))
    with pytest.raises(CheckpointException) as info:
        _loaded(tmp_path / "torch")
    text = str(info.value)
    assert "checkpoint of another format" in text and "FileSystemReader" in text
    assert "COMMITTED" not in text


def _save_in_worker(path: str) -> bool:
    daemonic = multiprocessing.current_process().daemon
    with StorageWriter(path) as writer:
        dcp.save(_state(), storage_writer=writer)
    return daemonic


def test_a_writer_in_a_daemonic_pool_worker_writes_from_a_thread(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_save_in_worker, (str(tmp_path / "c"),)) is True
    back = _loaded(tmp_path / "c")
    assert all(torch.equal(back[k], v) for k, v in _state().items())


def _process_executor(root: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from trainguard.checkpoint.dcp import AsyncStager

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out: dict[str, object] = {}
    try:
        with StorageWriter(f"{root}/x") as writer:
            for step in (1, 2):  # the second one overwrites, in DCP's background process
                state = {"w": torch.full((5,), float(step))}
                future = dcp.async_save(
                    state,
                    checkpoint_id=f"{root}/p",
                    storage_writer=writer,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                future.result()
                target = {"w": torch.zeros(5)}
                dcp.load(target, storage_reader=StorageReader(f"{root}/p"))
                out[f"loaded{step}"] = target["w"].tolist()
            with AsyncStager(writer) as stager:
                try:
                    dcp.async_save(
                        {"w": torch.zeros(5)},
                        checkpoint_id=f"{root}/q",
                        storage_writer=writer,
                        async_stager=stager,
                        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    )
                except ConfigError as exc:
                    out["refused"] = str(exc)
    finally:
        dist.destroy_process_group()
    return out


def test_async_save_with_the_process_executor(tmp_path: Path) -> None:
    (out,) = [r.get() for r in run_ranks(_process_executor, 1, args=(str(tmp_path),), timeout=240)]
    assert out["loaded1"] == [1.0] * 5 and out["loaded2"] == [2.0] * 5, out
    assert "AsyncCheckpointerType.THREAD" in str(out["refused"]), out
    assert not (tmp_path / "q").exists()
