"""trainguard report: a recorded real run (4 ranks, one injected fault) and hand-made event lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests._report_job import recorded_run
from trainguard import report
from trainguard.report import PHASES

STEPS, EVERY, FAULT_RANK, FAULT_STEP, STEP_S = 30, 5, 2, 17, 0.01
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rows_add_up(rep: report.Report) -> None:
    assert rep.productive >= 0 and rep.ckpt_stall >= 0 and rep.other >= 0
    total = rep.productive + rep.ckpt_stall + rep.fault_total + rep.other
    assert total == pytest.approx(rep.wall, abs=1e-3)
    for fault in rep.faults:
        assert all(fault.phases[name] >= 0 for name in PHASES), fault.phases
        assert sum(fault.phases.values()) == pytest.approx(fault.total, abs=1e-9)
        assert fault.bounds == sorted(fault.bounds)
        assert fault.bounds[0] >= 0 and fault.bounds[-1] <= rep.wall + 1e-9


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks, 30 steps, checkpoints after steps 4, 9, 14...; rank 2 raises at step 17."""
    directory = tmp_path_factory.mktemp("recorded") / "events"
    results = run_ranks(
        recorded_run,
        4,
        args=(str(directory), STEPS, EVERY, FAULT_RANK, FAULT_STEP, STEP_S),
        timeout=150,
    )
    assert [r.get() for r in results] == [STEPS] * 4
    return directory


def test_recorded_run_totals(run_dir: Path) -> None:
    rep = report.load(run_dir)
    assert rep.rounds == 2 and rep.ranks == [0, 1, 2, 3]
    assert len(rep.faults) == 1
    fault = rep.faults[0]
    assert (fault.round, fault.kind, fault.rank, fault.step) == (0, "exception", 2, FAULT_STEP)
    assert fault.restarted and "injected at step 17" in fault.cause
    # the newest checkpoint before the fault holds step 14: steps 15 and 16 ran twice; step 17
    # was interrupted before its end (no train_step), so it is not a recomputed execution
    assert fault.recomputed_steps == rep.recomputed_steps == 2
    assert rep.steps_kept == STEPS and rep.step_executions == STEPS + 2
    assert rep.ckpt_stalls["local"]["count"] == 6  # steps 4, 9, 14 | 19, 24, 29
    assert rep.ckpt_stall > 0
    _rows_add_up(rep)
    assert 0 < rep.goodput <= 1  # type: ignore[operator]
    assert rep.goodput == pytest.approx(rep.productive / rep.wall)
    assert rep.productive >= STEPS * STEP_S  # every kept step slept STEP_S
    # the fault's phases are real: an abort was measured and the next round had to start
    assert fault.phases["abort"] > 0 and fault.phases["reinit"] > 0
    assert fault.phases["recomputed"] >= 2 * STEP_S


def test_cli_table_and_json_match(run_dir: Path) -> None:
    rep = report.load(run_dir)
    out = _cli(str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(json.dumps(rep.to_dict()))
    out = _cli(str(run_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout == report.format_table(rep) + "\n"
    assert "fault 1: round 0, exception on rank 2 at step 17" in out.stdout
    assert "recomputed (2 steps)" in out.stdout and "goodput:" in out.stdout


def test_plot_writes_a_png(run_dir: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    path = tmp_path / "timeline.png"
    out = _cli(str(run_dir), "--plot", str(path))
    assert out.returncode == 0, out.stderr
    assert f"timeline written to {path}" in out.stdout
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    height, width = imread(path).shape[:2]
    assert width > 800 and height > 200


def test_plot_without_matplotlib_names_the_extra(run_dir: Path, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from trainguard.cli import main\n"
        f"raise SystemExit(main(['report', {str(run_dir)!r}, '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "pip install 'trainguard[report]'" in out.stderr
    assert not (tmp_path / "x.png").exists()


def test_cli_fails_clearly_without_events(tmp_path: Path) -> None:
    out = _cli(str(tmp_path))
    assert out.returncode == 1 and "no events under" in out.stderr and not out.stdout
    with pytest.raises(ValueError, match="no events"):
        report.load(tmp_path)
    with pytest.raises(ValueError, match="no events"):
        report.analyze([])


# hand-made event lists -----------------------------------------------------------------------
def ev(time: float, kind: str, rank: int | None = 0, rnd: int | None = 0, **fields: Any) -> dict:
    return {"time": time, "kind": kind, "rank": rank, "round": rnd, "pid": 100 + (rank or 0),
            **fields}  # fmt: skip


def steps(ranks: int, rnd: int, first: int, last: int, t: float, step_s: float = 1.0) -> list:
    """Steps first..last on every rank, back to back from time ``t``; each takes ``step_s``."""
    return [
        ev(t + (s - first + 1) * step_s, "train_step", r, rnd, step=s, duration=step_s)
        for s in range(first, last + 1)
        for r in range(ranks)
    ]


def test_no_faults() -> None:
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += steps(2, 0, 0, 9, 2.0)  # steps end at 3.0 ... 12.0
    events += [ev(7.5, "ckpt_stall", r, what="disk", step=4, duration=0.5) for r in range(2)]
    events += [ev(13.0, "complete", r) for r in range(2)]
    rep = report.analyze(events)
    assert rep.faults == [] and rep.fault_total == 0 and rep.recomputed_steps == 0
    assert rep.wall == 13.0
    # the stall sits inside step 5's span here, so it is not counted twice
    assert rep.productive == pytest.approx(10.0) and rep.ckpt_stall == pytest.approx(0.0)
    assert rep.goodput == pytest.approx(10.0 / 13.0)
    assert rep.other == pytest.approx(3.0)
    _rows_add_up(rep)


def _hang_run(with_injection: bool) -> list[dict]:
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += steps(2, 0, 0, 5, 1.0)  # steps 0..5 end at 2..7
    events += [ev(5.2, "ckpt_stall", r, what="local", step=3, duration=0.2) for r in range(2)]
    if with_injection:
        events.append(ev(7.0, "demo_fault", 1, fault="hang", step=6, target=1))
    events.append(ev(8.0, "hang", 1, soft=True, reason="no progress for 1.0 s"))
    events += [ev(8.5, "abort", r, duration=0.4, fault_rank=1, cause="fault") for r in range(2)]
    events += [ev(9.0, "round_start", 0, 1), ev(9.25, "round_start", 1, 1)]
    events += steps(2, 1, 4, 9, 10.0)  # resumes after the checkpoint of step 3
    events += [ev(16.5, "complete", r, 1) for r in range(2)]
    return events


def test_hang_fault_phases() -> None:
    rep = report.analyze(_hang_run(with_injection=True))
    assert rep.rounds == 2 and len(rep.faults) == 1
    fault = rep.faults[0]
    assert (fault.kind, fault.rank, fault.step, fault.round) == ("hang", 1, 6, 0)
    assert fault.recomputed_steps == 2  # steps 4 and 5
    assert fault.cause == "no progress for 1.0 s"
    assert fault.phases == pytest.approx(
        {
            "recomputed": 1.8,  # end of step 3's stall (5.2; the step ended at 5.0) -> 7.0
            "detection": 1.0,  # 7.0 -> hang event at 8.0
            "abort": 0.5,  # -> 8.5
            "barrier": 0.75,  # -> the latest round_start of round 1
            "reinit": 0.75,  # -> first step start of round 1 (10.0)
        }
    )
    assert rep.productive == pytest.approx(4.0 + 6.0)  # steps 0..3, then 4..9
    assert rep.ckpt_stall == pytest.approx(0.2)
    assert rep.wall == 16.5 and rep.other == pytest.approx(16.5 - 10.0 - 0.2 - 4.8)
    _rows_add_up(rep)


def test_hang_without_injection_event_has_unknown_detection() -> None:
    fault = report.analyze(_hang_run(with_injection=False)).faults[0]
    assert fault.kind == "hang" and fault.rank == 1 and fault.step is None
    assert fault.phases["detection"] == 0.0
    assert fault.phases["recomputed"] == pytest.approx(2.8)  # 5.2 -> hang event at 8.0


def test_killed_rank_replaced_by_a_spare() -> None:
    """Rank 1 is killed; its sidecar's events carry no round; spare rank 2 goes on in round 1."""
    events = [ev(0.0, "round_start", r, rank_in_round=r if r < 2 else None) for r in range(3)]
    events += steps(2, 0, 0, 3, 1.0)
    events.append(ev(5.5, "demo_fault", 0, fault="kill", step=4, target=1))
    events.append(ev(5.6, "rank_gone", 1, None, duration=0.05, gone_rank=1, gone_round=0,
                     cause="process died (SIGKILL)"))  # fmt: skip
    events.append(ev(5.7, "abort", 0, duration=0.1))
    events += [ev(6.0, "round_start", r, 1) for r in (0, 2)]
    events += [ev(7.0 + s, "train_step", r, 1, step=4 + s, duration=1.0) for s in range(3)
               for r in (0, 2)]  # fmt: skip
    events += [ev(9.5, "complete", r, 1) for r in (0, 2)]
    rep = report.analyze(events)
    fault = rep.faults[0]
    assert (fault.kind, fault.rank, fault.round) == ("kill", 1, 0)
    assert fault.cause == "process died (SIGKILL)" and fault.recomputed_steps == 0
    assert fault.phases["detection"] == pytest.approx(0.05)  # 5.5 -> rank_gone began at 5.55
    assert fault.phases["reinit"] == pytest.approx(0.0) and rep.ranks == [0, 1, 2]
    _rows_add_up(rep)


def test_missing_train_steps_are_reported_not_fatal(tmp_path: Path) -> None:
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += [ev(3.0, "fault", 1, error="ValueError: x", type="ValueError")]
    events += [ev(3.2, "abort", r, duration=0.1) for r in range(2)]
    events += [ev(3.5, "round_start", r, 1) for r in range(2)]
    events += [ev(9.0, "complete", r, 1) for r in range(2)]
    rep = report.analyze(events)
    assert rep.goodput is None and rep.productive == 0 and rep.step_executions == 0
    assert any("no train_step events" in note for note in rep.notes)
    assert rep.faults[0].kind == "exception (ValueError)" and rep.faults[0].rank == 1
    _rows_add_up(rep)
    table = report.format_table(rep)
    assert "goodput: unknown" in table and "no train_step events" in table
    pytest.importorskip("matplotlib")
    from trainguard.report._plot import plot_timeline

    plot_timeline(events, rep, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_SIGNATURE


def test_torn_lines_and_a_rank_served_by_two_processes(tmp_path: Path) -> None:
    lines = [ev(0.0, "round_start", 0), ev(1.0, "train_step", 0, step=0, duration=0.5)]
    # the same rank number from another process (a replacement) in round 1
    lines += [ev(1.2, "round_start", 0, 1) | {"pid": 999}]
    lines += [ev(2.0, "train_step", 0, 1, step=1, duration=0.5) | {"pid": 999}]
    with open(tmp_path / "events-h-1.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in lines)
        f.write('{"time": 3.0, "kind": "train_st')  # killed mid-write
    rep = report.load(tmp_path)
    assert rep.step_executions == 2 and rep.steps_kept == 2 and rep.ranks == [0]
    assert rep.wall == 2.0 and rep.productive == pytest.approx(1.0)
    assert [f.kind for f in rep.faults] == ["unknown"]  # a new round with no fault recorded
    _rows_add_up(rep)


def test_many_faults_are_summed_up_in_the_table() -> None:
    events: list[dict] = []
    for n in range(25):  # every round but the last ends with rank 0 raising
        events += [ev(10.0 * n, "round_start", r, n) for r in range(2)]
        events += steps(2, n, n, n, 10.0 * n + 1.0)
        if n < 24:
            events.append(ev(10.0 * n + 5.0, "fault", 0, n, error="ValueError: x", type="E"))
    events += [ev(245.0, "complete", r, 24) for r in range(2)]
    rep = report.analyze(events)
    assert len(rep.faults) == 24 and rep.productive == pytest.approx(25.0)
    _rows_add_up(rep)
    table = report.format_table(rep)
    assert "fault 20: round 19" in table and "fault 21:" not in table
    rest = sum(f.total for f in rep.faults[20:])
    line = next(x for x in table.splitlines() if "faults 21-24 (see --json)" in x)
    assert f" {rest:.3f} s" in line


def test_lost_directory_injection_is_listed_but_not_the_fault_moment() -> None:
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += steps(2, 0, 0, 3, 0.0)
    events.append(ev(4.0, "demo_fault", 0, fault="kill", step=4, target=1))
    events.append(ev(4.1, "demo_fault", 0, fault="lostdir", step=4, target=0))
    events.append(ev(4.5, "rank_gone", 1, None, gone_rank=1, gone_round=0, cause="SIGKILL"))
    events += [ev(5.0, "round_start", 0, 1), ev(6.0, "train_step", 0, 1, step=4, duration=0.5)]
    fault = report.analyze(events).faults[0]
    assert (fault.kind, fault.rank, fault.injected) == ("kill", 1, ["kill", "lostdir"])
    assert fault.phases["detection"] == pytest.approx(0.5)


def test_steps_without_duration_are_noted() -> None:
    events = [ev(0.0, "round_start"), ev(1.0, "train_step", step=0), ev(2.0, "complete")]
    rep = report.analyze(events)
    assert rep.productive == 0 and rep.goodput == 0
    assert any("1 train_step events have no duration" in note for note in rep.notes)


def test_reinit_is_split_and_training_again_is_shown(tmp_path: Path) -> None:
    """Round 1's set-up events split its re-initialization; its first step is shown beside."""
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += steps(2, 0, 0, 3, 1.0)  # steps 0..3 end at 2..5
    events.append(ev(5.5, "fault", 1, error="ValueError: x", type="ValueError"))
    events += [ev(5.6, "abort", r, duration=0.05) for r in range(2)]
    events += [ev(6.0, "round_start", r, 1) for r in range(2)]  # re-initialization 6.0 -> 7.0
    events += [ev(6.2, "pg_setup", 0, 1, duration=0.2), ev(6.3, "pg_setup", 1, 1, duration=0.25)]
    events += [ev(6.4, "ckpt_setup", r, 1, duration=0.1) for r in range(2)]
    events.append(ev(6.6, "local_ckpt_load", 0, 1, duration=0.25, source="memory"))  # 6.35..6.6
    events.append(ev(6.6, "local_ckpt_load", 1, 1, duration=0.1, source="peer"))
    events += steps(2, 1, 4, 6, 7.0, step_s=0.5)  # first step 7.0 -> 7.5
    events += [ev(9.0, "complete", r, 1) for r in range(2)]
    rep = report.analyze(events)
    fault = rep.faults[0]
    assert fault.phases["reinit"] == pytest.approx(1.0)
    # load 6.35..6.6; checkpointer 6.3..6.4 less the load; process group 6.0..6.3
    assert fault.reinit == pytest.approx(
        {"checkpoint_load": 0.25, "checkpointer": 0.05, "process_group": 0.3, "other": 0.4}
    )
    assert sum(fault.reinit.values()) == pytest.approx(fault.phases["reinit"])
    assert fault.load_source == "memory+peer"
    assert fault.first_step == pytest.approx(0.5) and fault.training_again == pytest.approx(2.0)
    _rows_add_up(rep)
    assert rep.productive == pytest.approx(4.0 + 1.5)  # the first step stays productive
    table = report.format_table(rep)
    for text in ("process-group set-up", "checkpointer set-up", "other (the function"):
        assert text in table
    line = next(x for x in table.splitlines() if "checkpoint find/load (memory+peer)" in x)
    assert " 0.250 s" in line
    assert "stepping again 2.000 s after the fault (first step of the next round: 0.500 s" in table
    as_json = json.loads(json.dumps(rep.to_dict()))["faults"][0]
    assert as_json["reinit"]["process_group"] == pytest.approx(0.3)
    pytest.importorskip("matplotlib")
    from trainguard.report._plot import plot_timeline

    plot_timeline(events, rep, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_SIGNATURE


def test_failed_and_unchanged_saves_are_counted_and_shown() -> None:
    events = [ev(0.0, "round_start", r) for r in range(2)]
    events += steps(2, 0, 0, 9, 2.0)
    events += [
        ev(6.0, "ckpt_failure", r, checkpointer="AsyncCheckpointer", count=1) for r in (0, 1)
    ]
    events += [ev(9.0, "ckpt_unchanged", 0, path="ckpt/step8", previous="ckpt/step4")]
    events += [ev(13.0, "complete", r) for r in range(2)]
    rep = report.analyze(events)
    assert (rep.failed_saves, rep.unchanged_saves) == (2, 1)
    assert rep.to_dict()["failed_saves"] == 2
    table = report.format_table(rep)
    assert "checkpoint saves: 2 failed and reported" in table and "1 identical" in table
    quiet = report.format_table(report.analyze([e for e in events if "ckpt_" not in e["kind"]]))
    assert "checkpoint saves:" not in quiet


def test_cli_takes_the_directory_above_the_event_log(run_dir: Path, tmp_path: Path) -> None:
    """`trainguard report RUN` and `trainguard events RUN`, where the logs are in RUN/events
    (what `trainguard demo` prints), read RUN/events; a directory without any names where
    they are expected."""
    assert run_dir.name == "events"
    direct, above = _cli(str(run_dir)), _cli(str(run_dir.parent))
    assert above.returncode == 0, above.stderr
    assert above.stdout == direct.stdout and above.stdout.startswith("trainguard report:")
    listed = subprocess.run(
        [sys.executable, "-m", "trainguard", "events", str(run_dir.parent), "--kind", "fault"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count(" fault ") == 1, listed.stdout
    empty = _cli(str(tmp_path))
    assert empty.returncode == 1 and "RUN/events" in empty.stderr, empty.stderr


def test_the_hosts_part_says_how_many_causes_it_left_out() -> None:
    """Four causes on one host: three are listed, the line says what the rest add up to, so
    that the listed counts never seem to miss faults."""
    from trainguard.report import _hosts

    causes = ["A @ t.py:1", "A @ t.py:1", "Hang", "RankGone", "B @ t.py:2", "C @ t.py:3"]
    events = [
        {"kind": "fault_attributed", "fault_host": "h1", "cause": c, "counted": True}
        for c in causes
    ]
    (line,) = _hosts.lines(_hosts.summary(events))[1:]
    assert line.startswith("  h1: 6 faults (6 counted): 2 x A @ t.py:1; 1 x Hang; 1 x RankGone")
    assert line.endswith("; 2 more of 2 other cause(s)"), line
