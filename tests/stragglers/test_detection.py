"""Straggler detection with 4 real ranks (gloo, the wrapper's own store, real sleeps)."""

from __future__ import annotations

from typing import Any

from tests._dist import run_ranks
from tests.stragglers import _jobs
from trainguard.events import read_events


def _of(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


def test_names_the_slow_rank_only_and_never_waits_for_a_hung_one(tmp_path) -> None:
    results = run_ranks(_jobs.detect_job, 4, args=(str(tmp_path),), timeout=120)
    for r in results:
        assert r.get()["threads"] == []  # the detector's thread ended with the call
    evs = read_events(tmp_path)
    windows = [e for e in _of(evs, "straggler_window") if e["rank"] == 0]
    every = _jobs.EVERY
    first_slow = _jobs.STRAGGLE.start // every + 1  # the first window of the slow rank
    hang_window = _jobs.HANG // every
    # a uniform job, and the same job uniformly twice as slow: nobody is named ...
    uniform = [e for e in windows if e["window"] < first_slow]
    assert len(uniform) >= first_slow - 3
    assert all(e["named"] == [] for e in uniform), uniform
    # ... but each rank's individual score (vs its own best) shows the slowdown
    slower = [e for e in uniform if e["window"] > _jobs.SLOWER.start // every + 1]
    assert slower and all(e["individual"] < 0.7 for e in slower), slower
    # the rank slowed by 30 % is named within 3 windows, in its section, and only it is (up
    # to the hang: without collectives the ranks' windows drift apart and load shows)
    named = [e for e in _of(evs, "straggler") if e["window"] < hang_window]
    assert {e["rank"] for e in named} == {_jobs.SLOW}, named
    first = min(e["window"] for e in named)
    assert first_slow <= first <= first_slow + 2, named
    assert all(e["section"] == "compute" and e["action"] == "reported" for e in named)
    assert all(0.6 < e["relative"] < 0.87 for e in named)
    slow_windows = [e for e in windows if first_slow <= e["window"] < hang_window]
    assert all(e["named"] in ([], [_jobs.SLOW]) for e in slow_windows), slow_windows
    assert sum(e["named"] == [_jobs.SLOW] for e in slow_windows) >= len(slow_windows) / 2
    # rank HUNG hangs: the other ranks' windows are scored meanwhile, without it
    (began,) = _of(evs, "test_hang")
    (ended,) = _of(evs, "test_hang_end")
    during = [e for e in windows if began["time"] < e["time"] < ended["time"]]
    # (the first ones may still hold what it published before it hung)
    without = [e for e in during if _jobs.HUNG in e["missing"]]
    assert len(without) >= 5, (len(during), during[-3:])
    assert _jobs.HUNG in during[-1]["missing"]


def test_policy_replaces_one_persistent_straggler_and_keeps_to_its_rate_limit(tmp_path) -> None:
    # initial ranks 1 and 2 are twice as slow as rank 0; 3 is the spare; one removal an hour
    results = run_ranks(_jobs.take_out_job, 4, args=(str(tmp_path), 60), timeout=150)
    out = {r.rank: r.get() for r in results}
    for value in out.values():
        assert value["threads"] == []
    left = [r for r, v in out.items() if v["error"] is not None]
    assert len(left) == 1 and left[0] in (1, 2), out
    (gone,) = left
    (stayed,) = {1, 2} - {gone}
    assert out[gone]["error"] == "StragglerError"
    # the spare took the number the straggler had; the others kept theirs
    assert out[3]["seen"] == [(1, gone)], out
    assert out[0]["seen"] == [(0, 0), (1, 0)]
    assert out[stayed]["seen"] == [(0, stayed), (1, stayed)]
    evs = read_events(tmp_path)
    actions = {(e["rank"], e["round"], e["action"]) for e in _of(evs, "straggler")}
    assert (gone, 0, "taken out") in actions
    assert all(a != "taken out" for r, _, a in actions if r != gone), actions
    # the other straggler went on straggling in round 1, and the rate limit kept it in
    assert (stayed, 1, "rate limited") in actions, actions
    (fault,) = [e for e in _of(evs, "fault") if e.get("type") == "Straggler"]
    assert fault["rank"] == gone and "compute" in fault["error"]
