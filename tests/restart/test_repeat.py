"""A fault that can only repeat ends the job; a function that cannot take its arguments is
refused at the first call."""

from __future__ import annotations

from typing import Any

import pytest

import trainguard.restart as tr
from tests._dist import run_ranks
from trainguard.errors import ConfigError, RetryLimitError
from trainguard.restart._repeat import Repeats

_calls = 0  # calls of the wrapped function in this rank's process


def repeat_job(fail_rounds: int, ping: bool, limit: int | None = -1) -> dict[str, Any]:
    """Rank 1 raises the same error in the first ``fail_rounds`` rounds (``limit`` -1: the
    default ``max_repeated_faults``)."""
    config: dict[str, Any] = {"max_repeated_faults": limit} if limit != -1 else {}

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60, sidecar=False, **config)
    def train(call: tr.CallWrapper) -> int:
        global _calls
        _calls += 1
        if ping:
            call.ping()
        if call.round < fail_rounds and call.rank == 1:
            raise ValueError("the batch is bad")
        return call.round

    try:
        return {"value": train(), "calls": _calls}
    except RetryLimitError as exc:
        return {"error": str(exc), "causes": exc.causes, "calls": _calls}


def test_the_same_fault_without_progress_ends_the_job_on_every_rank() -> None:
    results = [r.get() for r in run_ranks(repeat_job, 2, args=(20, False), timeout=120)]
    for res in results:
        assert "error" in res, res  # not restarted 20 times
        assert res["calls"] == 3  # rounds 0, 1, 2 failed; round 3's barrier ended the job
        assert "3 rounds in a row" in res["error"]
        assert "ValueError: the batch is bad" in res["error"]
        assert "max_repeated_faults" in res["error"]  # the setting that changes this
        assert "rank 1" in res["error"]


def test_faults_with_progress_between_them_keep_restarting() -> None:
    results = [r.get() for r in run_ranks(repeat_job, 2, args=(5, True), timeout=120)]
    assert [res.get("value") for res in results] == [5, 5], results


def test_max_repeated_faults_none_keeps_restarting() -> None:
    results = [r.get() for r in run_ranks(repeat_job, 2, args=(5, False, None), timeout=120)]
    assert [res.get("value") for res in results] == [5, 5], results


def test_repeats_count_only_the_same_cause_without_progress() -> None:
    run = Repeats()
    run = run.after({1: "ValueError: x (a.py:3 in f)"}, progress=False)
    run = run.after({0: "ValueError: x (a.py:3 in f)"}, progress=False)
    assert (run.count, run.rank) == (2, 0)
    assert run.verdict(3) is None and run.verdict(2) is not None
    assert run.after({0: "ValueError: x (a.py:4 in f)"}, progress=False).count == 1  # moved
    assert run.after({0: "ValueError: x (a.py:3 in f)"}, progress=True).count == 0
    assert run.after({}, progress=False).count == 0  # a hang or a death: another fault
    assert run.verdict(None) is None
    assert Repeats.decode(run.encode()) == run
    for garbage in (None, 3, {"cause": 1}, {"cause": "x", "rank": "0", "count": 2}):
        assert Repeats.decode(garbage) == Repeats()


@pytest.mark.parametrize("limit", [0, -1, 2.5, "3", True])
def test_max_repeated_faults_is_checked(limit: object) -> None:
    with pytest.raises(ConfigError, match="max_repeated_faults"):
        tr.Wrapper(max_repeated_faults=limit)  # type: ignore[arg-type]


def test_a_call_parameter_without_annotation_is_refused_at_the_first_call() -> None:
    @tr.Wrapper(sidecar=False)
    def train(call):  # type: ignore[no-untyped-def]  # the mistake under test
        return call.rank

    with pytest.raises(ConfigError, match=r"annotated CallWrapper.*has none") as info:
        train()
    assert "missing a required argument: 'call'" in str(info.value)


def test_arguments_the_function_does_not_take_are_refused_at_the_first_call() -> None:
    @tr.Wrapper(sidecar=False)
    def train(call: tr.CallWrapper, steps: int) -> int:
        return steps

    with pytest.raises(ConfigError, match="passes the CallWrapper as 'call'"):
        train(10, 20)


def test_a_call_that_fails_to_start_leaves_the_next_call_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call refused before its first round (here: no RANK in the environment) must not
    leave the process marked as inside a wrapped call: the next call gets its own error, not
    "a wrapped function cannot call a wrapped function" (that mark once stayed set)."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)

    @tr.Wrapper(sidecar=False)
    def train(call: tr.CallWrapper) -> int:
        return call.rank

    for _ in range(2):
        with pytest.raises(ConfigError, match="cannot tell this process's rank"):
            train()
