"""The save worker is an object of its own: built from the parts it uses (a stager, a writer
process, the round it is bound to, a result queue), never from a checkpointer."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import load
from trainguard.checkpoint._rebind import RoundBinding
from trainguard.checkpoint._save_work import SaveWorker
from trainguard.checkpoint._saves import Job, Outcomes, SaveHandle
from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.write import place
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriterProcess
from trainguard.errors import CheckpointWriteError


@pytest.fixture
def parts() -> Iterator[tuple[Stager, WriterProcess]]:
    stager = Stager(threads=1, pin=False)
    writer = WriterProcess(nice=0, start_timeout=60.0)
    writer.start()
    try:
        yield stager, writer
    finally:
        writer.stop()
        stager.close()


def _job(stager: Stager, state: dict[str, torch.Tensor], path: str) -> Job:
    flat = flatten(state)
    placed, nbytes = place(flat.entries)
    buffer, _ = stager.ensure(nbytes)
    handle = SaveHandle(0, path, path)
    return Job(handle, flat, placed, buffer, "trainguard", True, None, None, time.monotonic())


def test_a_worker_stages_writes_and_finishes_one_save(
    parts: tuple[Stager, WriterProcess], tmp_path: Path
) -> None:
    stager, writer = parts
    results: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
    worker = SaveWorker(
        stager=stager,
        writer=writer,
        slot=RoundBinding(),  # a single process: rank 0 of 1, no committer
        results=results,
        fsync=True,
        close_timeout=30.0,
    )
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    job = _job(stager, state, str(tmp_path / "one.safetensors"))
    worker.one(job)  # overlapped: the worker stages it first, then has it written
    outcomes = [results.get_nowait(), results.get_nowait()]
    assert [kind for kind, _ in outcomes] == ["durable", "committed"]
    assert job.handle.committed and job.handle.info is not None
    assert (job.handle.info.rank, job.handle.info.world_size) == (0, 1)
    loaded = load(tmp_path / "one.safetensors")
    assert torch.equal(loaded["w"], state["w"]) and int(loaded["step"]) == 7


def test_a_worker_that_gave_up_fails_the_save_and_writes_nothing(
    parts: tuple[Stager, WriterProcess], tmp_path: Path
) -> None:
    stager, writer = parts
    results: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
    worker = SaveWorker(
        stager=stager,
        writer=writer,
        slot=RoundBinding(),
        results=results,
        fsync=True,
        close_timeout=2.0,
    )
    worker.give_up()
    path = tmp_path / "late.safetensors"
    job = _job(stager, {"w": torch.ones(4)}, str(path))
    worker.one(job)
    kind, _ = results.get_nowait()
    assert kind == "failed"
    assert job.handle.error is not None and "gave up" in str(job.handle.error.causes)
    assert not path.exists()


def test_a_failed_save_is_raised_in_poll_and_only_logged_when_its_round_ended(
    parts: tuple[Stager, WriterProcess], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stager, _ = parts
    for logged in (False, True):
        outcomes = Outcomes()
        job = _job(stager, {"w": torch.ones(2)}, str(tmp_path / f"{logged}.safetensors"))
        outcomes.pending.append(job.handle)
        assert outcomes.open() == [job.handle]
        outcomes.results.put((job.finish({0: "disk full"}, world_size=1), job))
        job.handle.finished.set()
        if logged:
            with caplog.at_level(logging.WARNING, "trainguard.checkpoint._saves"):
                outcomes.deliver(logged=True)
            assert "did not commit" in caplog.text and "disk full" in caplog.text
        else:
            with pytest.raises(CheckpointWriteError, match="failed") as raised:
                outcomes.deliver()
            assert raised.value.causes == {0: "disk full"}
        assert outcomes.pending == [] and outcomes.late(0.0) is None
