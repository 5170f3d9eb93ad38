"""coord.commit against a real TCPStore, participants as threads."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.coord import _helpers
from trainguard.coord import CommitRound, Outcome
from trainguard.coord.commit import COMMITTED, FAILED, UNCONFIRMED
from trainguard.errors import CoordinationError

N = 3


def _keys(store: Any, prefix: str) -> list[str]:
    names = ["count", "decision", "outcome", "seen"]
    names += [f"{kind}/{r}" for r in range(N) for kind in ("err", "done")]
    return [name for name in names if store.check([f"{prefix}/{name}"])]


def test_every_report_ok_commits_once_and_the_keys_go(store) -> None:
    acts: list[int] = []

    def participant(r: int) -> Outcome:
        time.sleep(0.02 * r)
        round_ = CommitRound(store.clone(), "c", rank=r, world_size=N)
        outcome = round_.report(act=lambda: acts.append(r)) or round_.wait(10)
        round_.close()
        return outcome

    outcomes = _helpers.in_threads(participant, N)
    assert {o.state for o in outcomes.values()} == {COMMITTED}
    assert {o.decider for o in outcomes.values()} == {N - 1} and acts == [N - 1]
    assert _keys(store, "c") == []


def test_one_failure_fails_it_on_everyone_naming_each_cause(store) -> None:
    def participant(r: int) -> Outcome:
        round_ = CommitRound(store.clone(), "f", rank=r, world_size=N)
        outcome = round_.report(None if r == 0 else f"disk {r} full") or round_.wait(10)
        round_.close()
        return outcome

    outcomes = _helpers.in_threads(participant, N)
    assert all(o.state == FAILED for o in outcomes.values())
    assert all(dict(o.causes) == {1: "disk 1 full", 2: "disk 2 full"} for o in outcomes.values())
    assert _keys(store, "f") == []


def test_first_decision_wins_and_a_late_report_after_failed_does_not_commit(store) -> None:
    """Rank 2 reports after the others gave up waiting: its report completes the count, but
    the decision is "failed" already: it never acts (no marker) and undoes its preparation."""
    steps: list[str] = []

    def early(r: int) -> Outcome:
        round_ = CommitRound(store.clone(), "late", rank=r, world_size=N)
        assert round_.report() is None
        return round_.wait(0.3)

    early_outcomes = _helpers.in_threads(early, 2)
    assert all(o.failed for o in early_outcomes.values())
    first = early_outcomes[0]
    assert early_outcomes[1] == first  # one decision, whoever timed out first
    assert list(first.causes) == [2] and "did not report" in first.causes[2]
    late = CommitRound(store.clone(), "late", rank=2, world_size=N)
    assert (
        late.report(
            prepare=lambda: steps.append("prepare"),
            act=lambda: steps.append("act"),
            discard=lambda: steps.append("discard"),
        )
        is None
    )
    assert steps == ["prepare", "discard"]
    assert late.wait(5) == first
    for r in range(N):
        CommitRound(store, "late", rank=r, world_size=N).close()
    assert _keys(store, "late") == []


def test_abandon_wakes_every_waiter_at_once(store) -> None:
    def participant(r: int) -> tuple[Outcome, float]:
        round_ = CommitRound(store.clone(), "a", rank=r, world_size=N)
        started = time.monotonic()
        if r == 0:
            time.sleep(0.3)
            assert round_.abandon("restart")
            assert not round_.abandon("again")  # decided already
        round_.report()
        return round_.wait(30), time.monotonic() - started

    results = _helpers.in_threads(participant, N)
    assert all(o.failed and dict(o.causes) == {0: "restart"} for o, _ in results.values())
    assert all(seconds < 5 for _, seconds in results.values())  # not the 30 s timeout


def test_a_committed_decision_is_never_overturned_and_unconfirmed_keeps_parts(store) -> None:
    """The decider decided "committed" but has not published (it is slow renaming its
    marker): a participant that times out cannot fail the round; it learns "unconfirmed"."""
    started = threading.Event()
    release = threading.Event()

    def slow_act() -> None:
        started.set()
        release.wait(30)

    decider = CommitRound(store.clone(), "u", rank=1, world_size=2)
    waiter = CommitRound(store.clone(), "u", rank=0, world_size=2)
    assert waiter.report() is None
    thread = threading.Thread(target=decider.report, kwargs={"act": slow_act})
    thread.start()
    assert started.wait(10)
    outcome = waiter.wait(0.2)
    assert outcome.state == UNCONFIRMED and not outcome.failed and list(outcome.causes) == [1]
    assert not waiter.abandon("too late")
    release.set()
    thread.join(10)
    assert waiter.wait(1).committed


def test_more_reports_than_participants_is_an_error(store) -> None:
    CommitRound(store, "x", rank=0, world_size=1).report()
    with pytest.raises(CoordinationError, match="share one key prefix"):
        CommitRound(store, "x", rank=0, world_size=1).report()


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"[]",
        b'{"state": "committed", "causes": {"x": "y"}}',
        b'{"state": "failed", "causes": 3}',
        b'{"state": "committed", "by": "0"}',
    ],
)
def test_a_garbage_outcome_is_a_coordination_error(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match="malformed commit outcome"):
        Outcome.decode(raw)
