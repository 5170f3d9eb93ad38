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
    # the rank slowed by 30 % is named within 3 windows, in its section, and only it is
    named = _of(evs, "straggler")
    assert {e["rank"] for e in named} == {_jobs.SLOW}, named
    first = min(e["window"] for e in named)
    assert first_slow <= first <= first_slow + 2, named
    assert all(e["section"] == "compute" and e["action"] == "reported" for e in named)
    assert all(0.6 < e["relative"] < 0.85 for e in named if e["window"] < hang_window)
    slow_windows = [e for e in windows if first_slow + 2 <= e["window"] < hang_window]
    assert slow_windows and all(e["named"] == [_jobs.SLOW] for e in slow_windows)
    assert all(e["slowest"][0][0] == _jobs.SLOW for e in slow_windows)
    # rank HUNG hangs: the other ranks' windows are scored meanwhile, without it
    (began,) = _of(evs, "test_hang")
    (ended,) = _of(evs, "test_hang_end")
    during = [e for e in windows if began["time"] < e["time"] < ended["time"]]
    assert len(during) >= 5, (len(during), windows[-3:])
    assert all(_jobs.HUNG in e["missing"] for e in during[1:])
