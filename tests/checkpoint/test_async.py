"""AsyncCheckpointer in one process: callbacks, events, busy policy, overlap fence, failures."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import assert_same, sample_state
from trainguard import events
from trainguard.checkpoint import AsyncCheckpointer, latest, load
from trainguard.errors import CheckpointError, CheckpointWriteError, ConfigError


def test_callbacks_run_in_poll_and_wait_with_info(tmp_path: Path, no_leaks) -> None:
    seen: list[tuple[str, object]] = []
    with AsyncCheckpointer() as ckpt:
        state = {"w": torch.randn(1000, 100), "step": 1}
        handle = ckpt.save(
            state,
            tmp_path / "s1",
            on_durable=lambda info: seen.append(("durable", info)),
            on_commit=lambda info: seen.append(("commit", info)),
        )
        assert handle is not None
        handle.finished.wait(60)
        assert seen == []  # nothing runs behind the caller's back
        ckpt.poll()
        assert [k for k, _ in seen] == ["durable", "commit"]
        info = seen[0][1]
        assert info.nbytes == 400_000 and info.file_bytes >= 400_000 and info.throughput > 0
        assert info.staged_seconds <= info.durable_seconds
        assert handle.committed
    assert_same(load(tmp_path / "s1"), state)


def test_events_for_save_and_load(tmp_path: Path) -> None:
    log = events.configure(tmp_path / "events", rank=0)
    try:
        with AsyncCheckpointer() as ckpt:
            ckpt.save({"w": torch.ones(10)}, tmp_path / "c")
            ckpt.wait()
        load(tmp_path / "c")
    finally:
        log.close()
        events.configure(None)
    kinds = [e["kind"] for e in events.read_events(tmp_path / "events")]
    assert kinds == [
        "ckpt_setup",
        "ckpt_requested",
        "ckpt_staged",
        "ckpt_durable",
        "ckpt_committed",
        "ckpt_load",
    ]
    by = {e["kind"]: e for e in events.read_events(tmp_path / "events")}
    assert by["ckpt_setup"]["checkpointer"] == "async" and by["ckpt_setup"]["duration"] > 0
    assert by["ckpt_load"]["source"] == "file"
    assert by["ckpt_staged"]["bytes"] == 40 and by["ckpt_staged"]["duration"] >= 0
    assert by["ckpt_durable"]["throughput"] > 0 and by["ckpt_load"]["duration"] > 0


def test_steady_state_reuses_the_staging_buffer_and_grows_when_needed(tmp_path: Path) -> None:
    with AsyncCheckpointer() as ckpt:
        ckpt.save({"w": torch.randn(1 << 20)}, tmp_path / "a")
        buffer = ckpt._stager.buffer
        for i in range(3):
            ckpt.save({"w": torch.randn(1 << 20)}, tmp_path / f"b{i}")
            assert ckpt._stager.buffer is buffer
        ckpt.save({"w": torch.randn(3 << 20)}, tmp_path / "big")
        assert ckpt._stager.buffer is not buffer and ckpt._stager.buffer.nbytes >= 12 << 20
        ckpt.save({"w": torch.randn(3 << 20)}, tmp_path / "big2")
        ckpt.wait()
        assert buffer.tensor is None  # the old one was freed
    assert latest(tmp_path) == tmp_path / "big2"


def test_if_busy_skip_and_wait(tmp_path: Path) -> None:
    with AsyncCheckpointer() as ckpt:
        ckpt.save({"w": torch.ones(4)}, tmp_path / "warm")
        ckpt.wait()
        os.kill(ckpt.writer_pid, signal.SIGSTOP)  # the writer is "slow"
        try:
            first = ckpt.save({"w": torch.ones(4)}, tmp_path / "one")
            assert ckpt.save({"w": torch.ones(4)}, tmp_path / "two", if_busy="skip") is None
            timer = threading.Timer(0.5, os.kill, (ckpt.writer_pid, signal.SIGCONT))
            timer.start()
            started = time.monotonic()
            second = ckpt.save({"w": torch.zeros(4)}, tmp_path / "three")  # waits for "one"
            assert time.monotonic() - started >= 0.4
            assert first is not None and first.written.is_set() and second is not None
        finally:
            os.kill(ckpt.writer_pid, signal.SIGCONT)
        ckpt.wait()
    assert not (tmp_path / "two").exists()
    assert torch.equal(load(tmp_path / "three")["w"], torch.zeros(4))


def _slow_stage(ckpt: AsyncCheckpointer, delay: float) -> None:
    original = ckpt._stager.stage

    def stage(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    ckpt._stager.stage = stage  # type: ignore[method-assign]


@pytest.mark.parametrize("protect", [True, False])
def test_overlap_fence_keeps_the_optimizer_from_changing_unstaged_tensors(
    tmp_path: Path, protect: bool
) -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncCheckpointer() as ckpt:
        if protect:
            ckpt.protect(opt)
        _slow_stage(ckpt, 1.0)
        started = time.monotonic()
        handle = ckpt.save({"model": model.state_dict()}, tmp_path / "o", overlap=True)
        # save() returned long before the copy could have finished (a loaded machine may
        # stall this thread for a while: the margin is wide)
        assert time.monotonic() - started < 0.8 and not handle.staged.is_set()
        opt.step()  # with protect(): blocks until staged
        assert handle.staged.is_set() == protect
        ckpt.wait()
    saved = load(tmp_path / "o")["model"]
    same = all(torch.equal(saved[k], before[k]) for k in before)
    assert same == protect  # without the fence, the step leaks into the checkpoint


def test_wait_staged_is_the_explicit_fence(tmp_path: Path) -> None:
    x = torch.zeros(1000)
    with AsyncCheckpointer() as ckpt:
        _slow_stage(ckpt, 0.2)
        ckpt.save({"x": x}, tmp_path / "f", overlap=True)
        ckpt.wait_staged()
        x.fill_(1.0)
        ckpt.wait()
    assert torch.equal(load(tmp_path / "f")["x"], torch.zeros(1000))


def test_disk_full_is_reported_and_the_next_save_works(small_fs: Path, tmp_path: Path) -> None:
    with AsyncCheckpointer(on_error="raise") as ckpt:
        ckpt.save({"w": torch.ones(1000)}, small_fs / "ok")
        ckpt.wait()
        ckpt.save({"w": torch.ones(1 << 20)}, small_fs / "too_big")  # 4 MiB on 1 MiB
        with pytest.raises(CheckpointWriteError, match="ENOSPC") as err:
            ckpt.wait()
        assert 0 in err.value.causes
        assert sorted(os.listdir(small_fs)) == ["ok"]  # partial file removed
        x = torch.ones(3) * 2  # the training process is unharmed
        assert x.sum() == 6
        ckpt.save({"w": torch.ones(1000)}, small_fs / "next")
        ckpt.save({"w": torch.ones(1 << 20)}, tmp_path / "elsewhere")
        ckpt.wait()
    assert latest(small_fs) == small_fs / "next"
    assert torch.equal(load(tmp_path / "elsewhere")["w"], torch.ones(1 << 20))


def test_read_only_directory_is_reported(readonly_dir: Path, tmp_path: Path) -> None:
    with AsyncCheckpointer(on_error="raise") as ckpt:
        ckpt.save({"w": torch.ones(10)}, readonly_dir / "x")
        with pytest.raises(CheckpointWriteError, match=r"EROFS|EACCES|Read-only|Permission"):
            ckpt.wait()
        ckpt.save({"w": torch.ones(10)}, tmp_path / "y")
        ckpt.wait()
    assert torch.equal(load(tmp_path / "y")["w"], torch.ones(10))


def test_killed_writer_fails_the_save_and_is_replaced(tmp_path: Path, no_leaks) -> None:
    state = sample_state()
    with AsyncCheckpointer(on_error="raise") as ckpt:
        ckpt.save(state, tmp_path / "good")
        ckpt.wait()
        pid = ckpt.writer_pid
        os.kill(pid, signal.SIGSTOP)
        ckpt.save({"w": torch.randn(1 << 20)}, tmp_path / "doomed")
        time.sleep(0.5)  # let the background thread hand the job to the stopped writer
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CheckpointWriteError, match="writer process died"):
            ckpt.wait()
        assert sorted(os.listdir(tmp_path)) == ["good"]
        assert latest(tmp_path) == tmp_path / "good"
        ckpt.save(state, tmp_path / "after")
        ckpt.wait()
        assert ckpt.writer_pid not in (None, pid)
    assert_same(load(tmp_path / "after"), state)


def test_close_frees_everything_and_is_idempotent(tmp_path: Path, no_leaks) -> None:
    ckpt = AsyncCheckpointer(staging_threads=2)
    for i in range(3):
        ckpt.save({"w": torch.randn(1 << 22), "i": i}, tmp_path / f"s{i}", overlap=i == 1)
    ckpt.save({"w": torch.randn(1 << 23)}, tmp_path / "grown")
    ckpt.close()  # waits for pending saves
    ckpt.close()
    assert latest(tmp_path) == tmp_path / "grown"
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save({}, tmp_path / "z")


def test_bad_arguments_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="staging_threads"):
        AsyncCheckpointer(staging_threads=0)
    with pytest.raises(ConfigError, match="store"):
        AsyncCheckpointer(rank=1, world_size=2)
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(ConfigError, match="format"):
            ckpt.save({}, tmp_path / "x", format="pickle")
        with pytest.raises(ConfigError, match="if_busy"):
            ckpt.save({}, tmp_path / "x", if_busy="drop")


def test_latest_ignores_tmp_junk_and_missing(tmp_path: Path) -> None:
    assert latest(tmp_path / "nope") is None
    with AsyncCheckpointer() as ckpt:
        ckpt.save({"a": torch.ones(1)}, tmp_path / "real")
        ckpt.wait()
    (tmp_path / "newer.tmp").write_bytes(b"partial")
    (tmp_path / "junk").write_bytes(b"x" * 100)
    (tmp_path / "uncommitted").mkdir()
    assert latest(tmp_path) == tmp_path / "real"
    with pytest.raises(CheckpointError, match=r"only a \.tmp"):
        load(tmp_path / "newer")


def test_writer_is_light_and_low_priority(tmp_path: Path) -> None:
    with AsyncCheckpointer(writer_nice=7) as ckpt:
        ckpt.save({"w": torch.ones(10)}, tmp_path / "a")
        ckpt.wait()
        pid = ckpt.writer_pid
        stat = Path(f"/proc/{pid}/stat").read_text()
        nice = int(stat[stat.rfind(")") + 2 :].split()[16])
        assert nice >= 7
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps  # it neither imports torch nor re-runs __main__


def test_explicit_store_makes_a_committed_directory(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    commits: list[str] = []
    with AsyncCheckpointer(store=store, rank=0, world_size=1) as ckpt:
        ckpt.save({"w": torch.ones(3)}, tmp_path / "d", on_commit=lambda i: commits.append(i.path))
        ckpt.wait()
        ckpt.save({"w": torch.ones(3)}, tmp_path / "e", format="torch")
        ckpt.wait()
    assert commits == [str(tmp_path / "d")]
    assert sorted(os.listdir(tmp_path / "d")) == ["COMMITTED", "rank00000.safetensors"]
    assert torch.equal(load(tmp_path / "d")["w"], torch.ones(3))
    assert torch.equal(load(tmp_path / "e")["w"], torch.ones(3))
    assert latest(tmp_path) == tmp_path / "e"
    (tmp_path / "d" / "COMMITTED").unlink()
    from trainguard.errors import CheckpointUncommittedError

    with pytest.raises(CheckpointUncommittedError, match="allow_uncommitted"):
        load(tmp_path / "d")
    assert torch.equal(load(tmp_path / "d", allow_uncommitted=True)["w"], torch.ones(3))


def test_example_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "async_checkpoint.py"
    out = subprocess.run(
        [sys.executable, str(example), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "resumed run matches the uninterrupted one: True" in out.stdout


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_close_gives_up_on_a_stuck_writer_and_kills_it(tmp_path: Path, no_leaks) -> None:
    ckpt = AsyncCheckpointer(close_timeout=timedelta(seconds=2))
    ckpt.save({"w": torch.ones(10)}, tmp_path / "good")
    ckpt.wait()
    pid = ckpt.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # like a writer stuck in fsync: it never answers
    ckpt.save({"w": torch.ones(1 << 20)}, tmp_path / "stuck")
    started = time.monotonic()
    with pytest.raises(CheckpointWriteError, match=r"close_timeout=2 s.*killed"):
        ckpt.close()
    assert 2 <= time.monotonic() - started < 15
    assert _gone(pid)
    assert latest(tmp_path) == tmp_path / "good"
    assert not (tmp_path / "stuck").exists() and not list(tmp_path.glob("*stuck*.tmp"))


def test_timeouts_take_seconds_or_a_timedelta(tmp_path: Path) -> None:
    with AsyncCheckpointer(
        commit_timeout=timedelta(minutes=1), start_timeout=30, close_timeout=timedelta(seconds=90)
    ) as ckpt:
        assert (ckpt.commit_timeout, ckpt.close_timeout) == (60.0, 90.0)
        ckpt.save({"w": torch.ones(3)}, tmp_path / "t", overlap=True)
        ckpt.wait_staged(timedelta(seconds=30))
        ckpt.wait(timedelta(seconds=30))
        with pytest.raises(ConfigError, match="timeout"):
            ckpt.wait(timedelta(0))
    for bad in ({"commit_timeout": 0}, {"close_timeout": timedelta(0)}, {"start_timeout": "1"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            AsyncCheckpointer(**bad)
