"""A record never outlives the state it describes (issue 39, item 4): a rank whose tensors were
overwritten, in place by a transfer that did not complete or by a fallback's load that stopped
half way, must never be the donor of the next round. Real ranks, real faults, a real second
round after the one that overwrote the state; the job is tests/live/_jobs.py's."""

from __future__ import annotations

from pathlib import Path

from tests._dist import run_ranks
from tests.live._jobs import live_job, reference

STEPS = 10
AT = 5


def _round(values: list[dict[str, object]], round_: int) -> dict[int, dict[str, object]]:
    return {
        rec["rank"]: rec  # type: ignore[misc]
        for v in values
        for rec in v["recoveries"]  # type: ignore[attr-defined]
        if rec["round"] == round_
    }


def test_a_donor_killed_mid_transfer_leaves_its_receiver_torn_not_a_donor(tmp_path: Path) -> None:
    # rank 1 fails before its update of step AT while rank 0 finishes it: in the next round
    # rank 1 (at AT) receives AT + 1 from rank 0, in place (every tensor in messages of its
    # own), and rank 0 dies after two tensors are in rank 1's memory. The round after that has
    # rank 1 and the spare: rank 1's state is neither step, so nobody may resume from it.
    results = run_ranks(
        live_job,
        3,
        args=(STEPS, 2, "behind", 1, AT, str(tmp_path)),
        kwargs={"tamper_rank": 0, "tamper": "kill", "pack": 256},
        timeout=120,
    )
    assert results[0].exitcode == -9
    values = [results[1].get(), results[2].get()]
    assert [v["digest"] for v in values] == [reference(STEPS)] * 2
    fault = int((tmp_path / "fault").read_text())
    transfer = _round(values, fault + 1)
    assert transfer == {}  # rank 1's recover() raised when its donor died; the spare waited
    again = _round(values, fault + 2)
    assert sorted(again) == [0, 1]
    for rec in again.values():
        # before the fix: live at step AT, rank 1 the donor of the spare (wrong weights)
        assert not rec["live"], rec
        assert "replica group 0" in str(rec["fallback"]) and "1 torn" in str(rec["fallback"])


def test_an_interrupted_fallback_load_leaves_the_rank_torn_not_a_donor(tmp_path: Path) -> None:
    # rank 1 is torn at step AT; its only donor (rank 0) corrupts the transfer, so both fall
    # back; rank 0's load stops after the model (its weights are step 0's, its record said
    # AT + 1). In the round after, rank 0 must not give that state to rank 1.
    results = run_ranks(
        live_job,
        2,
        args=(STEPS, 2, "torn", 1, AT, str(tmp_path)),
        kwargs={"tamper_rank": 0, "interrupt_fallback": 0},
        timeout=120,
    )
    values = [r.get() for r in results]
    assert [v["digest"] for v in values] == [reference(STEPS)] * 2
    fault = int((tmp_path / "fault").read_text())
    assert int((tmp_path / "interrupted").read_text()) == fault + 1
    refused = _round(values, fault + 1)
    assert all(not rec["live"] for rec in refused.values())
    again = _round(values, fault + 2)
    assert sorted(again) == [0, 1]
    # before the fix: live at AT + 1 with rank 0 the donor. Now rank 0 is torn: the round
    # resumes from rank 1 (it restored step 0 and trained on) or falls back again
    assert all(rec["received_from"] != 0 for rec in again.values()), again
    assert again[0]["received_from"] == 1 or not again[0]["live"], again
    assert again[0]["step"] != AT + 1
