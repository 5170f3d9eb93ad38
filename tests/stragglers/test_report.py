"""The straggler part of ``trainguard report``: the table's lines and the timeline's marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard import report


def _events(named: bool) -> list[dict[str, Any]]:
    evs: list[dict[str, Any]] = []
    t = 1000.0
    for rank in range(3):
        evs.append({"time": t, "kind": "round_start", "rank": rank, "round": 0, "host": "h"})
    for w in range(1, 7):
        t += 1.0
        for rank in range(3):
            evs.append({"time": t, "kind": "train_step", "rank": rank, "round": 0,
                        "host": "h", "step": w, "duration": 0.9})  # fmt: skip
        slow = 0.7 if named and w >= 3 else 0.97
        evs.append({"time": t, "kind": "straggler_window", "rank": 0, "round": 0, "host": "h",
                    "window": w, "slowest": [[2, slow, "compute"], [1, 0.99, "step"]]})  # fmt: skip
        if named and w >= 3:
            evs.append({"time": t, "kind": "straggler", "rank": 2, "round": 0, "host": "node9",
                        "window": w, "section": "compute", "relative": slow - w / 100,
                        "individual": 0.5, "action": "reported"})  # fmt: skip
    if named:  # a one-window blip of another rank
        evs.append({"time": t, "kind": "straggler", "rank": 1, "round": 0, "host": "h",
                    "window": 6, "section": "step", "relative": 0.84, "action": "reported"})  # fmt: skip
    return evs


def test_report_lists_the_slowest_ranks_and_the_named_straggler(tmp_path: Path) -> None:
    rep = report.analyze(_events(named=True))
    named, blip = rep.stragglers["ranks"]
    assert blip["rank"] == 1 and blip["windows"] == 1
    assert named["rank"] == 2 and named["windows"] == 4 and named["host"] == "node9"
    assert named["worst"] == pytest.approx(0.64) and named["first"] == pytest.approx(3.0)
    text = report.format_table(rep)
    assert "stragglers: 1 rank named slower than the others" in text
    assert "rank 2 on node9: 4 windows from 3.0 s, section 'compute'" in text
    assert "below the threshold in one window only: rank 1 (step, 0.84)" in text
    quiet = report.format_table(report.analyze(_events(named=False)))
    assert "stragglers: none named in 6 scored windows; slowest: rank 2 0.97 (compute)" in quiet
    pytest.importorskip("matplotlib")
    from trainguard.report._plot import plot_timeline

    out = tmp_path / "t.png"
    plot_timeline(_events(named=True), rep, out)
    assert out.stat().st_size > 1000


def test_report_without_straggler_events_says_nothing_about_them() -> None:
    evs = [e for e in _events(named=False) if not e["kind"].startswith("straggler")]
    assert "straggler" not in report.format_table(report.analyze(evs))
