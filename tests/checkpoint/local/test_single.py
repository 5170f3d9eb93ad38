"""LocalCheckpointManager pieces that need no second rank: the clique layout, the agreement and
transfer-plan functions, a one-rank round trip without leaks, and retention."""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import assert_same, sample_state
from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager
from trainguard.checkpoint.local import _inventory
from trainguard.errors import CheckpointNotFoundError, CheckpointWriteError, ConfigError
from trainguard.restart._interrupt import Kick, raise_in
from trainguard.restart.state import RestartInterrupt


def test_clique_layouts() -> None:
    assert CliqueReplication(2, 4).cliques(8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert CliqueReplication(2, 1).cliques(8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert CliqueReplication(3, 2).cliques(6) == [[0, 2, 4], [1, 3, 5]]
    assert CliqueReplication(2, 2).cliques(6) == [[0, 2], [1, 3], [4], [5]]  # world shrank
    assert CliqueReplication(2, 2).clique_of(3, 4) == [1, 3]
    assert CliqueReplication(2, 4).describe() == "CliqueReplication(factor=2, jump=4)"
    assert CliqueReplication(2).describe() == "CliqueReplication(factor=2, by host)"
    assert CliqueReplication(2).clique_of(1, 4, ["a", "b", "a", "b"]) == [0, 1]
    with pytest.raises(ConfigError, match="host of each"):
        CliqueReplication(2).cliques(4)  # by host, without the hosts
    for bad in ({"factor": 0}, {"factor": 2.0}, {"factor": 2, "jump": 0}, {"factor": True}):
        with pytest.raises(ConfigError):
            CliqueReplication(**bad)  # type: ignore[arg-type]


def test_agreement_and_plan_are_functions_of_the_reports() -> None:
    s = "CliqueReplication(factor=2, jump=2)"
    reports = {  # rank 1 lost everything; owner 1 of iteration 3 lives on rank 3 only
        0: [[3, 0, 4, s, 100], [3, 2, 4, s, 100], [2, 0, 4, s, 90], [2, 2, 4, s, 90]],
        1: [],
        2: [[3, 2, 4, s, 100], [3, 0, 4, s, 100], [2, 2, 4, s, 90]],
        3: [[3, 3, 4, s, 100], [3, 1, 4, s, 100], [2, 3, 4, s, 90]],
    }
    merged = _inventory.holdings(reports)
    assert _inventory.complete(merged, 4) == [3]  # iteration 2 lacks owner 1
    assert _inventory.missing_owners(merged[2], 4) == [1]
    chosen = _inventory.choice(merged, 3)
    assert chosen.holders == {0: [0, 2], 2: [0, 2], 3: [3], 1: [3]}
    assert _inventory.plan(chosen, 4) == [(1, 3, 1)]
    assert _inventory.complete(merged, 2) == [3]  # a world of 2 needs owners 0 and 1 only
    assert chosen.orphans(2) == [2, 3]
    # a holder that already sends one part is not picked again while another is free
    two = _inventory.holdings(
        {0: [[5, 0, 3, s, 1], [5, 1, 3, s, 1], [5, 2, 3, s, 1]], 1: [], 2: []}
    )
    assert _inventory.plan(_inventory.choice(two, 5), 3) == [(1, 0, 1), (2, 0, 2)]


def test_bad_options_name_the_fix(tmp_path: Path) -> None:
    for kwargs, pattern in [
        ({"keep": 0}, "keep"),
        ({"backend": "mpi"}, "gloo"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": timedelta(0)}, "timeout"),
        ({"replication": 2}, "CliqueReplication"),
        ({"writer_nice": 40}, "writer_nice"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            LocalCheckpointManager(tmp_path, **kwargs)


@pytest.mark.usefixtures("no_leaks")
def test_one_rank_round_trip_and_nothing_leaks(tmp_path: Path) -> None:
    state = sample_state(3)
    expected = copy.deepcopy(state)
    with LocalCheckpointManager(tmp_path / "root", timeout=timedelta(seconds=30)) as mgr:
        assert mgr.find_latest() is None
        with pytest.raises(CheckpointNotFoundError, match="nothing to load"):
            mgr.load(5)
        mgr.save(state, 5)
        state["model"]["weight"].add_(1.0)  # after save() returns, changes do not count
        mgr.wait()
        assert mgr.find_latest() == 5
        back = mgr.load(5)
        assert_same(back, expected)
        torch.set_rng_state(back["rng"])
        del back
    with pytest.raises(Exception, match="closed"):
        mgr.save(state, 6)


def test_timeouts_take_seconds_or_a_timedelta(tmp_path: Path) -> None:
    with LocalCheckpointManager(tmp_path / "a", timeout=timedelta(minutes=2)) as mgr:
        assert mgr.timeout == 120.0
        mgr.save({"w": torch.ones(3)}, 1)
        mgr.wait(timedelta(seconds=30))
        mgr.save({"w": torch.ones(3)}, 2)
        mgr.wait(30)
        with pytest.raises(ConfigError, match="timeout"):
            mgr.wait(timedelta(seconds=-1))
    with LocalCheckpointManager(tmp_path / "b", timeout=45) as mgr:
        assert mgr.timeout == 45.0
    with pytest.raises(ConfigError, match="timeout"):
        LocalCheckpointManager(tmp_path / "c", timeout="45")


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


@pytest.mark.usefixtures("no_leaks")
def test_retention_keeps_complete_iterations_and_never_grows(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sizes = []
    with LocalCheckpointManager(root, keep=2, on_error="raise") as mgr:
        for it in range(50):
            mgr.save({"w": torch.full((4096,), float(it)), "it": it}, it)
            if it % 10 == 9:
                mgr.wait()
                assert _dirs(root) == [f"iter_{i:012d}" for i in (it - 1, it)]
                sizes.append(_bytes(root))
            else:
                assert len(_dirs(root)) <= 2 + 2  # keep + the one in flight + one unconfirmed
        assert len(set(sizes)) == 1, sizes
        # an incomplete newer iteration never removes a complete older one
        mgr.wait()
        (root / f"iter_{50:012d}").write_text("not a directory")  # iteration 50 will fail
        mgr.save({"w": torch.zeros(4096), "it": 50}, 50)
        with pytest.raises(CheckpointWriteError):
            mgr.wait()
        assert f"iter_{48:012d}" in _dirs(root) and f"iter_{49:012d}" in _dirs(root)
        assert mgr.find_latest() == 49
        (root / f"iter_{50:012d}").unlink()
        mgr.save({"w": torch.zeros(4096), "it": 51}, 51)
        mgr.wait()
        assert _dirs(root) == [f"iter_{i:012d}" for i in (49, 51)]
        assert mgr.load(51)["it"] == 51
    assert not list(root.rglob("*.tmp"))
    assert os.listdir(root)


def test_silently_corrupted_own_copy_is_caught_at_load(tmp_path: Path) -> None:
    """A copy that changes without a new mtime (bit rot) is caught by load's own re-hash."""
    from trainguard.checkpoint.format.read import read_header

    root = tmp_path / "root"
    with LocalCheckpointManager(root, keep=3) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((1 << 16,), float(it)), "it": it}, it)
        mgr.wait()
        assert mgr.find_latest() == 2  # verified and remembered
        (path,) = (root / f"iter_{2:012d}").iterdir()
        st = path.stat()
        start = read_header(path).data_start
        with open(path, "r+b") as f:
            f.seek(start + 100)
            f.write(b"\x01")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        # the staging buffer still holds iteration 2: restored from memory, the file unread
        assert mgr.load(2)["it"] == 2 and mgr.last_load["source"] == "memory"
        mgr._remembered = None  # as once the buffer holds another state: the file is read
        back = mgr.load(2)
        assert back["it"] == 1 and torch.equal(back["w"], torch.full((1 << 16,), 1.0))


def _later(delay: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(delay, action)
    timer.start()
    return timer


def test_an_interrupted_rebind_leaves_the_ended_round_to_the_next(tmp_path: Path) -> None:
    """A restart interrupt that lands in bind() while the ended round's thread still waits for
    the writer (here: stopped) leaves that thread to the next bind(), which finishes it before
    the new round's thread starts: two threads never read one writer's answers (they would
    take each other's, and every later save would fail)."""
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    kick = Kick.install()
    assert kick is not None
    state = sample_state(2)
    mgr = LocalCheckpointManager(tmp_path / "root", timeout=30)
    writer = mgr._writer.pid
    assert writer is not None
    try:
        os.kill(writer, signal.SIGSTOP)
        mgr.save(sample_state(1), 1)  # its thread now waits for the stopped writer

        def interrupt() -> None:
            raise_in(main)
            Kick.send(main)

        timer = _later(0.3, interrupt)
        with pytest.raises(RestartInterrupt):
            mgr.bind()  # the interrupt lands while it waits for the ended round's thread
        timer.join()
        timer = _later(0.5, lambda: os.kill(writer, signal.SIGCONT))
        mgr.bind()
        # running: interrupting a join() marks the thread joined stopped (bpo-45274's
        # handling in threading), so is_alive() cannot tell
        running = sys._current_frames()
        alive = [
            t for t in threading.enumerate() if t.name == "trainguard-local" and t.ident in running
        ]
        timer.join()
        assert len(alive) == 1, alive  # the new round's only
        mgr.save(state, 2)
        mgr.wait()
        assert mgr.find_latest() == 2
        assert_same(mgr.load(2), state)
    finally:
        os.kill(writer, signal.SIGCONT)
        kick.restore()
        mgr.close()
