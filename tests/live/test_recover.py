"""Live-state recovery with real ranks and real faults, compared bit for bit with a fault-free
run (see tests/live/_jobs.py for the job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._dist import run_ranks
from tests.live._jobs import live_job, reference
from trainguard.live._plan import FIRST_START, no_holder

STEPS = 12
AT = 6


def _run(tmp_path: Path, world: int, active: int, fault: str, victim: int, **kw: Any) -> list[Any]:
    results = run_ranks(
        live_job,
        world,
        args=(STEPS, active, fault, victim, AT, str(tmp_path)),
        kwargs=kw,
        timeout=120,
    )
    return results


def _values(results: list[Any], dead: set[int] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    return [r.get() for r in results if r.rank not in dead]


def _after(values: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """Every rank's recovery in the round after the fault's."""
    after = int((tmp_path / "fault").read_text()) + 1
    return [rec for v in values for rec in v["recoveries"] if rec["round"] == after]


def test_exception_in_backward_recovers_every_rank_in_place(tmp_path: Path) -> None:
    values = _values(_run(tmp_path, 3, 3, "backward", 1))
    ref = reference(STEPS)
    assert [v["digest"] for v in values] == [ref] * 3
    again = _after(values, tmp_path)
    assert len(again) == 3
    # nobody reached the update of step AT: the round resumes at AT and nothing is lost. The
    # faulting rank finished the update of step AT-1 before it raised, so it keeps its state
    # untouched. Another rank may not have finished that update when the abort came (its
    # last collective of step AT-1 cut short, or the update torn; possible on a loaded
    # machine). It then receives the state of step AT from a rank that holds it, and nothing
    # is recomputed.
    receivers = again[0]["receivers"]
    assert 1 not in receivers, receivers
    for rec in again:
        assert rec["live"] and rec["step"] == AT and rec["receivers"] == receivers
        assert rec["recomputed"] == 0
        if rec["rank"] in receivers:
            assert rec["received_from"] not in (None, *receivers), rec
        else:
            assert rec["received_from"] is None, rec


def test_exception_inside_optimizer_step_tears_one_rank_that_receives_from_a_donor(
    tmp_path: Path,
) -> None:
    values = _values(_run(tmp_path, 3, 3, "torn", 2))
    assert [v["digest"] for v in values] == [reference(STEPS)] * 3
    again = {rec["rank"]: rec for rec in _after(values, tmp_path)}
    # the others finished the update of step AT: the round resumes after it, the torn rank
    # (its first parameter group already updated) gets a donor's state
    assert all(rec["live"] and rec["step"] == AT + 1 for rec in again.values())
    assert again[2]["receivers"] == [2]
    assert again[2]["received_from"] in (0, 1)
    assert again[0]["received_from"] is None and again[1]["received_from"] is None
    assert all(rec["recomputed"] == 0 for rec in again.values())


def test_sigkill_with_a_spare_the_spare_receives_the_state(tmp_path: Path) -> None:
    results = _run(tmp_path, 3, 2, "kill", 1)
    assert results[1].exitcode == -9
    values = [results[0].get(), results[2].get()]
    ref = reference(STEPS)
    assert [v["digest"] for v in values] == [ref, ref]
    # the spare waited until the fault, then took rank 1
    after = int((tmp_path / "fault").read_text()) + 1
    rec = values[1]["recoveries"][0]
    assert rec["round"] == after
    assert rec["live"] and rec["step"] == AT and rec["received_from"] == 0
    assert rec["rank"] == 1 and rec["receivers"] == [1] and rec["recomputed"] == 0


def test_sigkill_without_a_spare_shrinks_and_keeps_the_live_state(tmp_path: Path) -> None:
    # no spare: the round goes on with the two survivors; their state is whole, nobody receives
    results = _run(tmp_path, 3, 3, "kill", 2)
    assert results[2].exitcode == -9
    values = [results[0].get(), results[1].get()]
    assert [v["digest"] for v in values] == [reference(STEPS)] * 2
    again = _after(values, tmp_path)
    assert len(again) == 2 and all(rec["live"] and rec["step"] == AT for rec in again)
    assert all(rec["receivers"] == [] for rec in again)


def test_a_corrupted_transfer_moves_to_the_next_donor(tmp_path: Path) -> None:
    # rank 2 is torn; its first donor (rank 0) flips a bit of what it sends: the checksum
    # refuses it and rank 1 gives the state in a second pass
    values = _values(_run(tmp_path, 3, 3, "torn", 2, tamper_rank=0))
    assert [v["digest"] for v in values] == [reference(STEPS)] * 3
    again = {rec["rank"]: rec for rec in _after(values, tmp_path)}
    assert again[2]["live"] and again[2]["received_from"] == 1
    assert all(rec["attempts"] == 2 for rec in again.values())


def test_a_corrupted_transfer_with_no_other_donor_falls_back(tmp_path: Path) -> None:
    values = _values(_run(tmp_path, 2, 2, "torn", 1, tamper_rank=0))
    # the fallback started again from step 0 (no checkpoint here) and still ends identical
    assert [v["digest"] for v in values] == [reference(STEPS)] * 2
    again = _after(values, tmp_path)
    assert len(again) == 2
    for rec in again:
        assert not rec["live"] and rec["step"] is None
        assert "checksum" in rec["fallback"] or "refused" in rec["fallback"]
        assert rec["newest"] == AT + 1
    from trainguard.events import read_events

    kinds = [(e["kind"], e.get("outcome")) for e in read_events(tmp_path)]
    assert ("live_recover", "fallback") in kinds and ("live_restored", None) in kinds
    restored = [e for e in read_events(tmp_path) if e["kind"] == "live_restored"]
    # round 0 is a first start (nothing to lose); round 1 recomputes the steps before the fault
    after = int((tmp_path / "fault").read_text()) + 1
    assert {e["recomputed"] for e in restored if e["round"] == after} == {AT + 1}
    assert {e["recomputed"] for e in restored if e["round"] == 0} == {0}  # a first start


def test_a_shard_without_an_untorn_replica_falls_back(tmp_path: Path) -> None:
    # every rank its own replica group (sharded state, no replicas): the torn rank's shard has
    # no other holder, so the round falls back to the checkpoint path
    values = _values(_run(tmp_path, 2, 2, "torn", 1, own_groups=True))
    assert [v["digest"] for v in values] == [reference(STEPS)] * 2
    again = _after(values, tmp_path)
    assert len(again) == 2
    assert all(not rec["live"] and "replica group 1" in rec["fallback"] for rec in again)


def test_holders_gone_the_fallback_says_so_and_is_no_first_start(tmp_path: Path) -> None:
    # the only rank that holds live state (rank 0; rank 1 waits as a spare) is SIGKILLed: the
    # spare's round falls back, and its reason is the loss, not "a first start"
    results = _run(tmp_path, 2, 1, "kill", 0)
    assert results[0].exitcode == -9
    (value,) = _values(results, dead={0})
    assert value["digest"] == reference(STEPS)
    after = int((tmp_path / "fault").read_text()) + 1
    (rec,) = [r for r in value["recoveries"] if r["round"] == after]
    assert not rec["live"] and rec["rank"] == 0
    assert rec["fallback"] == no_holder(after), rec
    from trainguard.events import read_events

    warned = [e for e in read_events(tmp_path) if e["kind"] == "live_recover"]
    assert {e["reason"] for e in warned if e["round"] == 0} == {FIRST_START}
    assert {e["reason"] for e in warned if e["round"] == after} == {no_holder(after)}
