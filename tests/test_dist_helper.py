"""The multi-rank helper itself: results, exceptions, timeouts, kills, leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from tests._dist import RankGroup, _group_members, free_port, run_ranks


def _all_reduce_sum(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        rank = dist.get_rank()
        out = []
        for step in range(steps):
            t = torch.tensor([float(rank + 1) * (step + 1)])
            dist.all_reduce(t)
            out.append(float(t.item()))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_all_reduce(world_size: int) -> None:
    results = run_ranks(_all_reduce_sum, world_size, args=(3,), timeout=90)
    expected_base = world_size * (world_size + 1) / 2
    expected = [expected_base * (s + 1) for s in range(3)]
    assert [r.get() for r in results] == [expected] * world_size


def _env_report() -> dict[str, str]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "EXTRA", "PER_RANK")
    keys += ("TG_TEST_SET_LATE",)
    return {k: os.environ.get(k, "-") for k in keys}


def test_every_rank_reports_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks(_env_report, 1)  # the forkserver is running before the environment changes
    monkeypatch.setenv("TG_TEST_SET_LATE", "late")
    results = run_ranks(
        _env_report, 3, env={"EXTRA": "x"}, rank_env=lambda r: {"PER_RANK": str(r * 10)}
    )
    envs = [r.get() for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_PORT"].isdigit()
    assert [e["PER_RANK"] for e in envs] == ["0", "10", "20"]
    assert {e["EXTRA"] for e in envs} == {"x"}
    # each rank sees the test process's environment at its start, as a spawned process does
    assert {e["TG_TEST_SET_LATE"] for e in envs} == {"late"}


def _raise_on_rank(bad: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    return rank


def test_exception_on_one_rank_is_reported_with_traceback() -> None:
    results = run_ranks(_raise_on_rank, 3, args=(1,))
    assert results[0].get() == 0 and results[2].get() == 2
    bad = results[1]
    assert not bad.ok
    assert bad.exc_type == "builtins.ValueError"
    assert bad.error == "boom on 1"
    assert "_raise_on_rank" in (bad.traceback or "")
    assert isinstance(bad.exception, ValueError)
    with pytest.raises(AssertionError, match="boom on 1"):
        bad.get()


def _hang_on_rank(bad: int, pid_file: str) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        # a grandchild in our process group: it must be killed with us
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        while True:
            time.sleep(1)
    return rank


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_hung_rank_is_killed_at_timeout_with_nothing_left(tmp_path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    start = time.monotonic()
    with RankGroup(_hang_on_rank, 2, args=(1, str(pid_file)), timeout=8) as group:
        group.start()
        results = group.join()
        rank_pids = [group.pid(r) for r in range(2)]
    elapsed = time.monotonic() - start
    assert elapsed < 30
    assert results[0].get() == 0
    assert results[1].timed_out and not results[1].ok
    with pytest.raises(AssertionError, match="timeout"):
        results[1].get()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert not any(_alive(p) for p in rank_pids)
    assert all(not _group_members(p) for p in rank_pids)


def _sleep_forever_after_marker(marker_dir: str) -> int:
    rank = int(os.environ["RANK"])
    open(os.path.join(marker_dir, f"ready{rank}"), "w").close()
    if rank == 1:
        time.sleep(600)
    return rank


def test_kill_chosen_rank_on_demand(tmp_path) -> None:
    with RankGroup(_sleep_forever_after_marker, 2, args=(str(tmp_path),), timeout=60) as group:
        group.start()
        group.wait_until(lambda: (tmp_path / "ready1").exists(), timeout=30)
        group.kill(1)
        results = group.join()
    assert results[0].get() == 0
    assert results[1].exitcode == -signal.SIGKILL
    assert not results[1].returned and not results[1].timed_out


def _leave_a_process_behind() -> None:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_leftover_processes_fail_the_run() -> None:
    with pytest.raises(AssertionError, match="left processes behind"):
        run_ranks(_leave_a_process_behind, 1, timeout=60, leftover_grace=1.0)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
