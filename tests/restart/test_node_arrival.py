"""Node arrival (:mod:`trainguard.restart.sidecar._arrival`):
the node watcher arrives at each barrier for its ranks, one append and one add per node.
Real ranks on this host (one node), a real TCPStore, real SIGKILLs. Each test reads the
watcher's log for its flushes, so that it fails if the ranks arrived on their own."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import trainguard.restart as tr
from tests._dist import RankGroup, run_ranks
from tests.restart import _arrival_jobs, _faults, _jobs
from trainguard.events import read_events

_FLUSH = re.compile(r"node arrival: round (\d+), ranks \[([\d, ]*)\]([^\n]*)")


def _flushes(out_dir: Path) -> list[tuple[int, list[int], bool]]:
    """The node watcher's flushes, in order: (round, ranks, it laid the round out)."""
    (log,) = out_dir.glob("sidecar-node-*.log")
    return [
        (
            int(m.group(1)),
            [int(r) for r in m.group(2).split(",") if r.strip()],
            "laid" in m.group(3),
        )
        for m in _FLUSH.finditer(log.read_text())
    ]


def _flushed(flushes: list[tuple[int, list[int], bool]], n: int) -> list[int]:
    return sorted(r for m, ranks, _ in flushes if m == n for r in ranks)


def test_a_faulted_run_ends_the_same_with_the_node_arriving_for_its_ranks(tmp_path) -> None:
    faulted = 3
    results = run_ranks(
        _faults.mixed_rounds_job,
        3,
        args=(faulted,),
        env={"TRAINGUARD_EVENTS_DIR": str(tmp_path)},
        timeout=180,
    )
    values = [r.get() for r in results]
    assert [v["result"] for v in values] == [faulted] * 3  # as without node arrival
    assert all(len(v["rounds"]) == faulted + 1 for v in values)
    flushes = _flushes(tmp_path)
    for n in range(faulted + 1):
        # every rank's record of every round went through the node, in few batches (one
        # unless a rank was more than the bound late), and the node laid each round out
        assert _flushed(flushes, n) == [0, 1, 2], flushes
        assert 1 <= sum(m == n for m, _, _ in flushes) <= 3, flushes
        assert [laid for m, _, laid in flushes if m == n].count(True) == 1, flushes


def _check_survivors(results, victim: int, world: int) -> None:
    for r in results:
        if r.rank == victim:
            assert r.exitcode == -9, r
            continue
        value = r.get()
        assert value["rounds"][-1]["world"] == world - 1, value["rounds"]
        assert len(value["weights"]) > 0


def test_a_rank_killed_after_it_handed_its_record_to_the_node(tmp_path) -> None:
    victim = 2
    results = run_ranks(
        _arrival_jobs.death_job,
        3,
        args=(victim, "sent", str(tmp_path)),
        timeout=120,
    )
    _check_survivors(results, victim, 3)
    flushes = _flushes(tmp_path)
    assert victim in _flushed(flushes, 1), flushes  # its record went in after its death
    assert _flushed(flushes, 1) == [0, 1, 2], flushes
    gone = [e for e in read_events(tmp_path) if e["kind"] == "rank_gone"]
    assert [(e["gone_rank"], e["counted"]) for e in gone] == [(victim, True)], gone
    # its departure (the notice's) won over its arrival (the node's): no round held it after
    assert all(
        victim not in e["active"]
        for e in read_events(tmp_path)
        if e["kind"] == "round_start" and e["round"] >= 2
    )


def test_a_rank_killed_before_it_handed_its_record_to_the_node(tmp_path) -> None:
    victim = 1
    results = run_ranks(
        _arrival_jobs.death_job,
        3,
        args=(victim, "unsent", str(tmp_path)),
        timeout=120,
    )
    _check_survivors(results, victim, 3)
    flushes = _flushes(tmp_path)
    # the node did not wait for the dead rank: the others' records, its departure by notice
    assert _flushed(flushes, 1) == [0, 2], flushes
    gone = [e for e in read_events(tmp_path) if e["kind"] == "rank_gone"]
    assert [(e["gone_rank"], e["counted"]) for e in gone] == [(victim, True)], gone


def test_the_watcher_killed_after_it_arrived_for_some_ranks(tmp_path) -> None:
    """The watcher arrived at round 1 for ranks 0 and 1 and dies before rank 2 comes: every
    rank arrives itself (again: harmless), round 1 is laid out, and every rank leaves with
    SidecarLostError as without node arrival."""
    start = time.monotonic()
    results = run_ranks(
        _arrival_jobs.watcher_death_job,
        3,
        args=(2, str(tmp_path)),
        timeout=120,
    )
    for r in results:
        assert r.exc_type == "trainguard.errors.SidecarLostError", r.traceback
    assert time.monotonic() - start < 90
    assert _flushed(_flushes(tmp_path), 1) == [0, 1]
    barriers = [e for e in read_events(tmp_path) if e["kind"] == "barrier" and e["round_"] == 1]
    assert sorted(e["rank"] for e in barriers) == [0, 1, 2], barriers


def test_a_newcomer_on_the_node_is_admitted_while_the_node_arrives_for_the_others(
    tmp_path,
) -> None:
    """Rank 1 dies in round 0; its new process (a newcomer, ``TRAINGUARD_INCARNATION=1``)
    registers with the same node watcher while ranks 0 and 2 run round 1: the node's ranks
    are in different rounds. The newcomer pools its record for round 2 itself (uncounted) and
    ends round 1; the node arrives for ranks 0 and 2 without waiting for it, lays round 2
    out and admits it."""
    overrides = {
        "rank_filter": tr.MaxActiveWorldSize(3),
        "rank_assignment": tr.FillGaps(),
        "store_timeout": 30,
        "soft_timeout": 5.0,
        "hard_timeout": 10.0,
    }
    env = {
        "TRAINGUARD_JOB_SECRET": f"arrival-{secrets.token_hex(12)}",
        "TRAINGUARD_JOB_ID": "arrival",
    }
    with RankGroup(
        _faults.fault_job,
        3,
        args=(6, 1, 2, "sigkill", str(tmp_path), overrides),
        kwargs={"hold_round": 1},
        timeout=90,
        env=env,
    ) as group:
        group.start()
        group.wait_until(lambda: not group.is_alive(1), timeout=40)
        joiner = group.respawn(1, {"TRAINGUARD_INCARNATION": "1"})
        results = group.join()
    expected = _jobs.reference(6, 3)
    for index in (0, 2, joiner):
        assert results[index].get()["weights"] == expected
    assert [(x["round"], x["world"]) for x in results[0].get()["rounds"]] == [
        (0, 3),
        (1, 2),
        (2, 3),
    ]
    assert [x["round"] for x in results[joiner].get()["rounds"]] == [2]
    flushes = _flushes(tmp_path)
    assert _flushed(flushes, 2) == [0, 2], flushes  # not the newcomer's: it pooled its own
    assert [laid for m, _, laid in flushes if m == 2][-1], flushes
    watched = re.findall(
        r"watching rank (\d+) ", next(tmp_path.glob("sidecar-node-*.log")).read_text()
    )
    assert sorted(int(r) for r in watched) == [0, 1, 1, 2]  # one watcher: the newcomer's too
    [admitted] = [e for e in read_events(tmp_path) if e["kind"] == "launch_admitted"]
    assert (admitted["rank"], admitted["round"]) == (1, 2)
