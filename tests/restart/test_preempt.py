"""Save on preemption with the plain Wrapper (no launcher): a real SIGTERM to every process of
every rank (each rank's process group: the rank, its store server, sidecar and checkpoint
writer), as Slurm's ``--signal`` delivers it."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest

from tests._dist import RankGroup, RankResult, run_ranks
from tests.restart._preempt_jobs import progress, train_job
from trainguard.checkpoint import latest, load
from trainguard.errors import ConfigError
from trainguard.restart import Preempted, WrapperConfig
from trainguard.restart.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(180)

STEPS = 60


def _preempt(out: Path, *, at: int, **kwargs: object) -> list[RankResult]:
    """Run 2 ranks until both passed step ``at``, SIGTERM every process of both, join."""
    with RankGroup(
        train_job, 2, args=(str(out),), kwargs={"steps": STEPS, **kwargs}, timeout=120
    ) as group:
        group.start()
        group.wait_until(
            lambda: all(any(p["step"] >= at for p in progress(out, r)) for r in (0, 1)),
            timeout=60,
        )
        for rank in (0, 1):
            group.kill(rank, signal.SIGTERM, whole_group=True)
        results = group.join()
        assert group.leftovers == []
    return results


def _preempted(result: RankResult) -> Preempted:
    assert result.exc_type == "trainguard.restart.preempt.Preempted", result.traceback
    assert isinstance(result.exception, Preempted)
    return result.exception


def test_sigterm_to_every_process_saves_one_step_and_the_resumed_run_is_bit_identical(
    tmp_path: Path,
) -> None:
    reference = [
        r.get()
        for r in run_ranks(
            train_job, 2, args=(str(tmp_path / "ref"),), kwargs={"steps": STEPS}, timeout=120
        )
    ]
    out = tmp_path / "run"
    results = _preempt(out, at=23)
    stops = {_preempted(r).step for r in results}
    assert len(stops) == 1, stops  # one agreed step
    (stop,) = stops
    assert stop is not None and stop > 23 and stop % 10  # not a periodic checkpoint
    assert all(_preempted(r).saved for r in results)
    assert all(_preempted(r).code == EXIT_PREEMPTED for r in results)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "Traceback" not in logs and "DistNetworkError" not in logs
    newest = latest(out / "ckpt")
    assert newest is not None and newest.name == f"step_{stop:06d}"
    assert load(newest, rank=0)["step"] == stop
    ran = {p["step"] for r in (0, 1) for p in progress(out, r)}
    assert max(ran) == stop - 1  # nobody ran the stop step
    # both ranks saved the local checkpoint of that step too
    assert all((out / "local" / f"rank{r}").exists() for r in (0, 1))

    resumed = [
        r.get()
        for r in run_ranks(train_job, 2, args=(str(out),), kwargs={"steps": STEPS}, timeout=120)
    ]
    assert resumed == reference  # bit for bit
    assert min(p["step"] for p in progress(out, 0) if p["step"] >= stop) == stop


def test_budget_ran_out_keeps_the_previous_checkpoint_and_logs_the_loss(tmp_path: Path) -> None:
    out = tmp_path / "run"
    results = _preempt(out, at=23, grace=2.0, late_rank=1)
    for r in results:  # the wrapped function raised Preempted, or the budget ended it
        assert r.exitcode == EXIT_PREEMPTED or not _preempted(r).saved, r
    newest = latest(out / "ckpt")
    assert newest is not None
    stop = max(p["step"] for p in progress(out, 0)) + 1
    assert (
        load(newest, rank=0)["step"] < stop and load(newest, rank=0)["step"] % 10 == 0
    )  # the periodic one
    assert not (out / "ckpt" / f"step_{stop:06d}" / "COMMITTED").exists()
    late = (out / "logs" / "rank-1.log").read_text()
    assert f"rank 1 was late: it had not finished saving step {stop}" in late
    first = (out / "logs" / "rank-0.log").read_text()
    assert f"step {stop} is lost, the newest committed checkpoint stays the latest" in first
    assert "Traceback" not in late + first


def test_the_grace_budget_comes_from_the_argument_the_environment_or_60_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainguard.launch.options import LaunchOptions

    monkeypatch.delenv("TRAINGUARD_PREEMPTION_GRACE", raising=False)
    assert WrapperConfig().preemption_grace == 60.0
    monkeypatch.setenv("TRAINGUARD_PREEMPTION_GRACE", "90")
    assert WrapperConfig().preemption_grace == 90.0
    assert LaunchOptions().preemption_grace == 90.0
    assert WrapperConfig(preemption_grace=timedelta(seconds=30)).preemption_grace == 30.0
    with pytest.raises(ConfigError, match="preemption_grace"):
        WrapperConfig(preemption_grace=-1)
    monkeypatch.setenv("TRAINGUARD_PREEMPTION_GRACE", "soon")
    with pytest.raises(ConfigError, match=r"TRAINGUARD_PREEMPTION_GRACE='soon' must be a number"):
        WrapperConfig()
