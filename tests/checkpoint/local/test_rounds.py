"""Checkpointers that outlive restart rounds: built once per process, outside the wrapped
function, used in every round (re-bound to each round by themselves), restoring from memory;
and a hot spare that prefetched the part it takes over. Real ranks, real faults."""

from __future__ import annotations

from pathlib import Path

from tests._dist import run_ranks
from tests.checkpoint.local import _round_jobs
from trainguard.events import read_events

ROUNDS = 20
WORLD = 3


def test_persistent_checkpointers_survive_twenty_faulted_rounds(tmp_path: Path) -> None:
    results = run_ranks(
        _round_jobs.persistent_job, WORLD, args=(str(tmp_path), ROUNDS), timeout=240
    )
    events = read_events(tmp_path / "events")
    for r in results:
        value = r.get()
        assert value["result"] == ROUNDS
        rounds = value["rounds"]
        assert [x["round"] for x in rounds] == list(range(ROUNDS + 1))
        # the same writer processes in every round: nothing restarted, nothing added
        assert all(x["writers"] == list(value["writers"]) for x in rounds)
        # every round after an even round's fault (saves durable) resumes from memory
        for x in rounds[1:]:
            assert x["found"] is not None
            if (x["round"] - 1) % 2 == 0:
                assert x["source"] == "memory", x
        # no growth in processes, threads, fds or shared memory across rounds
        steady = rounds[2:]
        for name in ("threads", "children", "memfds"):
            assert all(x[name] == steady[0][name] for x in steady), (name, steady)
        # a leak grows with every round; a connection mid-close may count for one sample
        fds = [x["fds"] for x in steady]
        assert fds[-1] <= min(fds[: len(fds) // 2]) + 1 and max(fds) - min(fds) <= 2, fds
        mapped = [x["mapped"] for x in steady]
        assert max(mapped) - min(mapped) <= 1, mapped
        # closed: no child process, memfd or mapping of either checkpointer remains
        after = value["after"]
        assert after["children"] == [] and after["memfds"] == [] and after["mapped"] == 0
        assert not any(t.startswith("trainguard") for t in after["threads"]), after
    setups = [e for e in events if e["kind"] == "ckpt_setup"]
    # built once, then re-bound in every round it was used (the disk one in even rounds at
    # least: in odd rounds the fault comes before its save)
    for kind, used in (("local", ROUNDS + 1), ("async", ROUNDS // 2 + 1)):
        mine = [e for e in setups if e["checkpointer"] == kind]
        assert len(mine) >= WORLD * (used + 1), (kind, len(mine))
        assert all(e["duration"] >= 0 and e["world_size"] in (1, WORLD) for e in mine)
    loads = [e for e in events if e["kind"] == "local_ckpt_load"]
    assert {e["source"] for e in loads} <= {"memory", "file", "peer"}
    assert sum(e["source"] == "memory" for e in loads) >= WORLD * ROUNDS // 2
    # where every rank restores from memory, load() follows find_latest() with no exchange
    fast = [e for e in loads if e.get("exchanges") == 0]
    assert len(fast) >= WORLD * ROUNDS // 2 and all(e["source"] == "memory" for e in fast)


def test_spare_takes_over_with_its_part_prefetched(tmp_path: Path) -> None:
    ranks, spares = 3, 1
    roots = [str(tmp_path / f"node{p}") for p in range(ranks + spares)]
    results = run_ranks(
        _round_jobs.spare_job, ranks + spares, args=(str(tmp_path), ranks, roots), timeout=180
    )
    by_process = {}
    for r in results:
        if r.rank == 1:
            assert r.exitcode == -9, r  # killed itself
            continue
        by_process[r.rank] = r.get()
    spare = by_process[ranks]
    assert spare["result"] == 2
    (load,) = spare["loads"]
    # the spare took rank 1 and read owner 1's part from the copy it prefetched: no transfer
    assert load["rank"] == 1 and load["iteration"] == 2
    assert load["source"].startswith("local ") and ".h99999." in load["source"], load
    events = read_events(tmp_path / "events")
    prefetch = [e for e in events if e["kind"] == "spare_prefetch" and e["iteration"] == 2]
    assert prefetch and prefetch[0]["bytes"] > 0 and prefetch[0]["parts"] == ranks
    taken = [e for e in events if e["kind"] == "local_ckpt_load" and e["copy"] == load["source"]]
    assert len(taken) == 1 and taken[0]["source"] == "file" and taken[0]["transfers"] == 0
    for value in by_process.values():
        assert value["after"]["children"] == [] and value["after"]["memfds"] == []
