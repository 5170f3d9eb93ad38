"""The per-slot state machine: respawn budget, back-off, crash loops (fake clock, no processes)."""

from __future__ import annotations

import pytest

from trainguard.launch._slots import Escalate, Respawn, SlotPolicy, SlotState, SlotTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, **policy: float) -> SlotTable:
    t = SlotTable({0: 4, 1: 5}, SlotPolicy(**policy), clock=clock)  # type: ignore[arg-type]
    t.started(0, 1000)
    t.started(1, 1001)
    return t


def test_exit_zero_marks_the_slot_done_and_all_done_needs_every_slot() -> None:
    clock = Clock()
    t = table(clock)
    assert t.exited(0, 0) is None
    assert t.state(0) is SlotState.DONE and not t.all_done
    assert t.running() == [1]
    assert t.exited(1, 0) is None
    assert t.all_done


def test_a_death_respawns_at_once_with_the_next_incarnation() -> None:
    clock = Clock()
    t = table(clock, respawns=3, crash_uptime=1.0)
    clock.now += 5
    decision = t.exited(0, -9)
    assert decision == Respawn(0, 1, clock.now, 2)
    assert t.state(0) is SlotState.WAITING and t.running() == [1]
    assert t.due() == [0]
    assert t.started(0, 2000) == 1
    assert t.incarnation(0) == 1 and t.pid(0) == 2000 and t.rank(0) == 4
    assert t.state(0) is SlotState.RUNNING and t.due() == []
    assert t.incarnation(1) == 0  # the other slot is untouched


def test_backoff_doubles_from_half_a_second_when_zero() -> None:
    policy = SlotPolicy(respawns=5, backoff=0.0)
    assert [policy.delay(k) for k in range(1, 5)] == [0.0, 0.5, 1.0, 2.0]
    policy = SlotPolicy(respawns=5, backoff=2.0)
    assert [policy.delay(k) for k in range(1, 4)] == [2.0, 4.0, 8.0]


def test_a_respawn_is_due_only_after_its_backoff() -> None:
    clock = Clock()
    t = table(clock, respawns=3, backoff=0.0, crash_uptime=1.0)
    for incarnation in (1, 2):
        clock.now += 5
        decision = t.exited(0, 1)
        assert isinstance(decision, Respawn) and decision.incarnation == incarnation
        if incarnation == 2:
            assert decision.at == clock.now + 0.5
            assert t.due() == []
            clock.now += 0.49
            assert t.due() == []
            clock.now += 0.02
        assert t.due() == [0]
        t.started(0, 3000 + incarnation)


def test_budget_exhausted_escalates() -> None:
    clock = Clock()
    t = table(clock, respawns=2, crash_uptime=1.0)
    for pid in (2001, 2002):
        clock.now += 60
        decision = t.exited(1, 1)
        assert isinstance(decision, Respawn)
        assert decision.budget_left == t.budget_left(1)
        clock.now += 10
        t.started(1, pid)
    clock.now += 60
    decision = t.exited(1, 1)
    assert isinstance(decision, Escalate)
    assert "rank 5" in decision.reason and "budget of 2" in decision.reason


def test_zero_respawns_escalates_at_the_first_death() -> None:
    t = table(Clock(), respawns=0)
    assert isinstance(t.exited(0, 1), Escalate)


def test_crash_loop_escalates_before_the_budget() -> None:
    clock = Clock()
    t = table(clock, respawns=10, crash_loop=3, crash_uptime=5.0)
    for k in range(2):
        clock.now += 1  # dies 1 s after its start: early
        assert isinstance(t.exited(0, 1), Respawn)
        clock.now += 10
        t.started(0, 4000 + k)
    clock.now += 1
    decision = t.exited(0, 1)
    assert isinstance(decision, Escalate) and "crash loop" in decision.reason


def test_a_long_run_resets_the_crash_loop_count() -> None:
    clock = Clock()
    t = table(clock, respawns=10, crash_loop=2, crash_uptime=5.0)
    clock.now += 1
    assert isinstance(t.exited(0, 1), Respawn)
    t.started(0, 5000)
    clock.now += 50  # ran well
    assert isinstance(t.exited(0, 1), Respawn)
    t.started(0, 5001)
    clock.now += 1
    assert isinstance(t.exited(0, 1), Respawn)  # one early death after a good run: no loop


def test_an_exit_of_a_slot_without_process_is_an_error() -> None:
    t = table(Clock())
    t.exited(0, 0)
    with pytest.raises(ValueError, match="no running process"):
        t.exited(0, 1)
