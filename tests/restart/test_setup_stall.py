"""A rank blocked in gloo's group constructor by a peer that published its address and never
connects is not ended: the constructor's connect phase is bounded (trainguard.restart._setup),
the round ends normally and the next one recovers from that rank's live state (issue 40,
item 7). Real processes, a real SIGSTOP."""

from __future__ import annotations

from pathlib import Path

from tests._dist import run_ranks
from tests.live._jobs import reference
from tests.restart._stall_jobs import stall_job

STEPS = 10
AT = 5


def test_a_rank_stalled_in_the_constructor_keeps_the_only_live_state(tmp_path: Path) -> None:
    results = run_ranks(stall_job, 3, args=(STEPS, AT, str(tmp_path), 2.0), timeout=150)
    assert results[1].exitcode == -9  # killed at step AT: rank 0 alone holds the state then
    # the rank that waited in the constructor for the stopped peer was not ended
    assert results[0].exitcode == 0, results[0]
    values = {r.rank: r.get() for r in results if r.rank != 1}
    assert [v["digest"] for v in values.values()] == [reference(STEPS)] * 2
    stalled = int((tmp_path / "stopped").read_text())
    assert stalled > int((tmp_path / "fault").read_text())
    after = [rec for v in values.values() for rec in v["recoveries"] if rec["round"] > stalled]
    first = min(rec["round"] for rec in after)
    again = {rec["rank"]: rec for rec in after if rec["round"] == first}
    assert set(again) == {0, 2}, after
    # recovered from rank 0's live state: nothing recomputed, no fall back to the start
    assert all(
        rec["live"] and rec["step"] == AT and rec["recomputed"] == 0 for rec in again.values()
    )
    assert again[2]["received_from"] == 0 and again[0]["received_from"] is None
