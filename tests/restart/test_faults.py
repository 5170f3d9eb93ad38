"""Deaths and hangs with real processes, a real store and real gloo (4 ranks, their node watcher)."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.restart import _faults, _jobs

STEPS = 10
FAULT_STEP = 4


def _watcher_log(tmp_path) -> str:
    """The node watcher's log (the events directory is ``tmp_path``): one for the 4 ranks."""
    (log,) = tmp_path.glob("sidecar-node-*.log")
    return str(log.read_text())


def _run(victim: int, kind: str, tmp_path, overrides=None):
    results = run_ranks(
        _faults.fault_job,
        4,
        args=(STEPS, victim, FAULT_STEP, kind, str(tmp_path), overrides),
        timeout=120,
    )
    fault_time = float((tmp_path / f"fault-{victim}").read_text())
    return results, fault_time


def _check_shrunk(results, victim: int, fault_time: float, *, within: float) -> None:
    """The survivors restarted without ``victim`` (ShiftRanks: world 3) and finished right."""
    expected = _jobs.reference(STEPS, 4, switch=FAULT_STEP, after=3)
    survivors = [r for r in range(4) if r != victim]
    for new_rank, rank in enumerate(survivors):
        value = results[rank].get()
        assert value["weights"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert [(x["round"], x["rank"], x["world"]) for x in value["rounds"]] == [
            (0, rank, 4),
            (1, new_rank, 3),
        ]
        latency = value["rounds"][1]["entered"] - fault_time
        assert 0 < latency < within, f"rank {rank} re-entered {latency:.3f} s after the fault"


@pytest.mark.parametrize(
    ("victim", "kind", "exitcode"), [(2, "sigkill", -9), (0, "sigkill", -9), (1, "exit", 1)]
)
def test_dead_process_survivors_restart_without_it_at_once(
    victim: int, kind: str, exitcode: int, tmp_path
) -> None:
    # heartbeat_timeout is 30 s: a restart within 2 s came from the death notice
    results, fault_time = _run(victim, kind, tmp_path)
    assert results[victim].exitcode == exitcode
    _check_shrunk(results, victim, fault_time, within=2.0)
    log = _watcher_log(tmp_path)
    assert "notice written" in log, log
    from trainguard.events import read_events

    gone = [e for e in read_events(tmp_path) if e["kind"] == "rank_gone"]
    assert [(e["gone_rank"], e["counted"]) for e in gone] == [(victim, True)]


@pytest.mark.parametrize("kind", ["sleep", "spin"])
def test_soft_hang_aborts_and_restarts_every_rank(kind: str, tmp_path) -> None:
    results, fault_time = _run(2, kind, tmp_path)
    expected = _jobs.reference(STEPS, 4, switch=FAULT_STEP, after=4)
    for rank, r in enumerate(results):
        value = r.get()
        assert value["weights"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert [(x["round"], x["rank"], x["world"]) for x in value["rounds"]] == [
            (0, rank, 4),
            (1, rank, 4),
        ]
        latency = value["rounds"][1]["entered"] - fault_time
        assert 1.0 <= latency < 1.0 + 2.0, f"rank {rank}: {latency:.3f} s"


def test_gil_held_hang_is_killed_by_the_node_watcher(tmp_path) -> None:
    results, fault_time = _run(2, "gil", tmp_path)
    assert results[2].exitcode in (-15, -9)
    # hard_timeout 3 s (+ up to 1 s grace); the others' soft timeouts fired first
    _check_shrunk(results, 2, fault_time, within=3.0 + 1.0 + 2.0)
    assert "rank 2: hard timeout" in _watcher_log(tmp_path)
    from trainguard.events import read_events

    seen = read_events(tmp_path)
    assert [e["killed_rank"] for e in seen if e["kind"] == "hard_timeout"] == [2]  # its watcher's
    assert ("hang", 2) not in [(e["kind"], e["rank"]) for e in seen]


def test_spare_takes_the_dead_ranks_number_and_training_is_unchanged(tmp_path) -> None:
    import trainguard.restart as tr

    overrides = {"rank_filter": tr.MaxActiveWorldSize(4), "rank_assignment": tr.FillGaps()}
    results = run_ranks(
        _faults.fault_job,
        5,
        args=(STEPS, 1, FAULT_STEP, "sigkill", str(tmp_path), overrides),
        timeout=120,
    )
    assert results[1].exitcode == -9
    expected = _jobs.reference(STEPS, 4, switch=FAULT_STEP, after=4)
    for rank in (0, 2, 3, 4):
        value = results[rank].get()
        assert value["weights"] == expected  # bit for bit: every rank number reads its shard
        seen = [(x["round"], x["rank"], x["world"]) for x in value["rounds"]]
        assert seen == ([(0, rank, 4)] if rank != 4 else []) + [(1, rank if rank != 4 else 1, 4)]


def test_too_few_survivors_end_with_an_error_naming_them(tmp_path) -> None:
    import trainguard.restart as tr

    overrides = {"retry": tr.RetryController(min_active_world_size=4)}
    results, _ = _run(2, "sigkill", tmp_path, overrides)
    for rank in (0, 1, 3):
        r = results[rank]
        assert r.exc_type == "trainguard.errors.RetryLimitError", r.traceback
        assert "min_active_world_size=4" in (r.error or "")
        assert "rank 2: process died" in (r.error or ""), r.error


def test_fifty_mixed_faulted_rounds_stay_flat() -> None:
    faulted = 50
    results = run_ranks(_faults.mixed_rounds_job, 4, args=(faulted,), timeout=300)
    for r in results:
        value = r.get()
        assert value["result"] == faulted
        rounds = value["rounds"][3:]
        for name in ("sockets", "os_threads", "handlers"):
            values = [x[name] for x in rounds]
            # a leak grows with every round; a connection mid-close may count for one sample,
            # and so may the next round's store client, connected ahead by a thread (a round
            # may sample before or while it connects)
            slack = 1 if name == "sockets" else 0
            half = len(values) // 2
            assert max(values[half:]) <= max(values[:half]) + slack, (name, values)
            assert max(values) - min(values) <= 1 + slack, (name, values)
        fds = [x["fds"] for x in rounds]
        assert max(fds) - min(fds) <= 2, fds
        assert len({tuple(x["children"]) for x in value["rounds"]}) == 1  # the same sidecar
        growth = rounds[-1]["rss"] - rounds[0]["rss"]
        assert growth < 20 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"
        assert value["after"]["children"] == []


def test_hard_timeout_kills_on_time_while_the_store_is_stopped(tmp_path) -> None:
    """The store process is stopped (SIGSTOP) right after rank 1 hangs holding the GIL: every
    store call of its sidecar blocks. The kill must come at the hard timeout all the same;
    the notice follows once the store runs again (SIGCONT after the kill)."""
    import os
    import signal
    import time

    from tests._dist import RankGroup, proc_stat

    marker = tmp_path / "fault-1"
    args = (STEPS, 1, FAULT_STEP, "gil", str(tmp_path), {"hard_timeout": 30.0})
    with RankGroup(
        _faults.fault_job,
        2,
        args=args,
        kwargs={"victim_overrides": {"hard_timeout": 3.0}},
        timeout=120,
    ) as group:
        group.start()
        group.wait_until(lambda: marker.exists() and marker.read_text() != "", timeout=60)
        store = _faults.child_pid(group.pid(0), b"trainguard.coord._server")
        assert store is not None
        os.kill(store, signal.SIGSTOP)
        try:
            fault_time = float(marker.read_text())
            group.wait_until(lambda: not group.is_alive(1), timeout=3.0 + 1.0 + 3.0)
            killed_after = time.time() - fault_time
            state = (proc_stat(store) or ["?"])[0]
        finally:
            os.kill(store, signal.SIGCONT)
        results = group.join()
    assert state == "T", "the store process was not stopped at the kill"
    assert 2.8 <= killed_after <= 3.0 + 1.0 + 0.5, f"killed {killed_after:.2f} s after the fault"
    assert results[1].exitcode in (-15, -9)
    value = results[0].get()
    assert value["weights"] == pytest.approx(
        _jobs.reference(STEPS, 2, switch=FAULT_STEP, after=1), rel=1e-12, abs=1e-12
    )
    assert [(x["round"], x["rank"], x["world"]) for x in value["rounds"]] == [(0, 0, 2), (1, 0, 1)]
    assert "rank 1: hard timeout" in _watcher_log(tmp_path)
    assert not group.leftovers


@pytest.mark.parametrize("when", ["before_add", "after_add"])
def test_death_inside_the_barrier_does_not_hold_the_others(when: str, tmp_path) -> None:
    """Rank 2 arrives last at round 0's barrier and dies after writing its record: before
    its count, or after it (it would have published the round). Its sidecar completes the
    arrival; the others start round 0 without it at once (barrier_timeout is 20 s).

    The rank arrives by itself, as one whose node watcher is gone; the deaths of a rank that
    handed its record to its node watcher are those of ``tests/restart/test_node_arrival.py``."""
    args = (2, when, str(tmp_path))
    results = run_ranks(_faults.barrier_death_job, 4, args=args, timeout=120)
    assert results[2].exitcode == -9
    died = float((tmp_path / "fault-2").read_text())
    expected = _jobs.reference(10, 4, switch=0, after=3)
    for new_rank, rank in enumerate((0, 1, 3)):
        value = results[rank].get()
        assert value["weights"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert [(x["round"], x["rank"], x["world"]) for x in value["rounds"]] == [(0, new_rank, 3)]
        latency = value["rounds"][0]["entered"] - died
        assert 0 < latency < 3.0, f"rank {rank} entered round 0 {latency:.2f} s after the death"
