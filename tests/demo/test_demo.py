"""``trainguard demo`` end to end, at small size: real processes, real faults, real checks.

One run (2 ranks + 1 spare, 60 steps, each fault kind once) is shared by the tests of this
module; a second run perturbs one bit after a restore and must fail the bit-identical check.
Every process the demo starts (ranks, spare, sidecars, store, checkpoint writers) inherits a
marker variable, so the tests can tell that none of them outlived the command.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._dist import live_processes
from trainguard import report
from trainguard.demo import faults
from trainguard.errors import ConfigError

# Above the 5 s that a TCPStore connect can stall (torch looks up the name of each client
# socket's IPv4-mapped address; a DNS server that drops the query costs glibc's 5 s timeout): a
# stall that long in the training thread is a hang to a 3 s soft timeout, and the run then has
# one fault more than it injected.
SOFT_TIMEOUT = 6
SCHEDULE = "exception@12:1,hang@24:0,kill@36:1,lostdir@48:0"


def _with_marker(marker: str) -> list[int]:
    found = []
    for pid in live_processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def run_demo(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    marker = f"tg-demo-test-{uuid.uuid4().hex}"
    env = {**os.environ, "TRAINGUARD_JOB_ID": marker}
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "demo", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    deadline = time.monotonic() + 15  # the store process exits when the last rank left
    while (left := _with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes outlived the demo: {left}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("demo") / "run"
    proc = run_demo(
        out, "--ranks", "2", "--spares", "1", "--steps", "60", "--local-every", "5",
        "--disk-every", "20", "--soft-timeout", str(SOFT_TIMEOUT), "--faults", SCHEDULE,
    )  # fmt: skip
    return out, proc


def test_demo_trains_through_every_fault_kind_bit_identically(demo_run) -> None:
    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for kind, step, rank in (("exception", 12, 1), ("hang", 24, 0), ("kill", 36, 1)):
        assert f"injected {kind} on rank {rank} before step {step}" in text
    assert "injected lostdir on rank 0 before step 48" in text
    assert text.count("training again") == 4  # one recovery line per fault
    assert text.count("stepping again after") == 4  # and one line on each recovery's parts
    assert "spare process 2 took over rank 1" in text
    # live state: every fault resumes where it struck, from the survivors' memory; the spare
    # that took over rank 1 received the state from a replica
    for step in (12, 24, 36, 48):
        assert f"resumed at step {step} from live state" in text, text
    assert "resumed at step 36 from live state (rank(s) [1] received it from a replica)" in text
    assert len(re.findall(r"from live state.*, 0 steps recomputed$", text, re.MULTILINE)) == 4
    assert len(re.findall(r": 0 steps recomputed, stepping again after", text)) == 4  # report
    assert "4 recoveries, 0 steps recomputed" in text
    assert "bit-identical: yes" in text
    assert sorted(p.name for p in (out / "faults").iterdir()) == [
        "000012-exception-r1.fired",
        "000024-hang-r0.fired",
        "000036-kill-r1.fired",
        "000048-lostdir-r0.fired",
    ]


def test_demo_writes_report_and_timeline(demo_run) -> None:
    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "report.json").read_text())
    assert [f["kind"] for f in data["faults"]] == ["exception", "hang", "kill", "lostdir"]
    assert data["rounds"] == 5 and data["steps_kept"] == 60
    parts = data["productive"] + data["ckpt_stall"] + data["fault_total"] + data["other"]
    assert parts == pytest.approx(data["wall"], abs=1e-3)
    # the hang costs at least the soft timeout of detection; the others far less
    hang = data["faults"][1]
    assert hang["phases"]["detection"] >= SOFT_TIMEOUT - 0.5
    for fault in data["faults"]:
        assert all(v >= 0 for v in fault["phases"].values())
        # recovered from live state: nothing is run twice, nothing is loaded from a file
        assert fault["recomputed_steps"] == 0, fault
        assert fault["load_source"] == "live", fault
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the same analysis from the command line
    again = report.load(out / "events")
    assert again.to_dict()["faults"] == data["faults"]
    assert (out / "report.txt").read_text().startswith("trainguard report:")


def test_a_perturbed_restore_fails_the_check(tmp_path: Path) -> None:
    proc = run_demo(
        tmp_path / "run", "--ranks", "2", "--spares", "0", "--steps", "30",
        "--local-every", "5", "--faults", "exception@12:1", "--perturb",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "bit-identical: NO" in proc.stdout
    assert "bit-identical: yes" not in proc.stdout


def test_without_live_state_faults_recover_from_checkpoints(tmp_path: Path) -> None:
    # --no-live: today's path, a lost directory's part comes from a peer's replica
    proc = run_demo(
        tmp_path / "run", "--ranks", "2", "--spares", "0", "--steps", "40",
        "--local-every", "5", "--soft-timeout", str(SOFT_TIMEOUT), "--no-live",
        "--faults", "exception@17:1,lostdir@28:0",
    )  # fmt: skip
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr
    assert "recovery from checkpoints only (--no-live)" in text
    assert "from live state" not in text
    assert "rank 0 (process 0) lost its copy: got its part from rank 1" in text
    # the save of step 15 is in the background: on a loaded machine the newest may be 10
    assert re.search(
        r"resumed at step 1[05] from local checkpoint 1[05], [27] steps recomputed", text
    )
    assert "bit-identical: yes" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--faults", "boom@3:1"], "unknown kind 'boom'"),
        (["--faults", "exception@3"], "is not KIND@STEP:RANK"),
        (["--faults", "kill@3:1", "--spares", "0"], "use --spares 1"),
        (["--faults", "hang@900:0"], "between 1 and 299"),
        (["--faults", "exception@5:7"], "rank 7 does not exist"),
        (["--ranks", "1"], "at least 2 ranks"),
        (["--launch", "--ranks", "4"], "drop --ranks/--spares"),
        (["--launch", "--step-time", "-1"], "--step-time must be 0 or more"),
        (["--model-mib", "-5"], "--model-mib must be 0"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "demo", "--out", str(tmp_path / "o"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_schedule_parsing() -> None:
    parsed = faults.parse("hang@20:1, exception@10:0", ranks=2, spares=0, steps=30)
    assert [f.label for f in parsed] == ["exception@10:0", "hang@20:1"]
    assert faults.parse("", ranks=2, spares=0, steps=30) == ()
    with pytest.raises(ConfigError, match="same step"):
        faults.parse("hang@20:1,exception@20:0", ranks=2, spares=0, steps=30)
    default = faults.parse(faults.DEFAULT_SCHEDULE, ranks=4, spares=1, steps=300)
    assert {f.kind for f in default} == set(faults.KINDS)


def test_each_fault_is_claimed_once(tmp_path: Path) -> None:
    fault = faults.Fault(5, 1, "exception")
    assert faults.claim(tmp_path, fault)
    assert not faults.claim(tmp_path, fault)
    with pytest.raises(faults.InjectedFault):
        faults.inject(fault)


def test_demo_lines_have_the_shapes_the_docs_quote(demo_run) -> None:
    """Every fault and recovery line a real run prints has the shape (numbers masked) of a
    line that the README and docs/demo.md quote, and the other way round: a change to what
    the demo prints fails here until the quotes are written again (bench/demo_transcript.py)."""
    from tests.demo.test_demo_docs import QUOTES, quoted, shape

    _, proc = demo_run
    kinds = ("  > round", "guarded run finished:", "bit-identical:")
    ran = {shape(line) for line in proc.stdout.splitlines() if line.startswith(kinds)}
    for name in QUOTES:
        docs = {shape(line) for line in quoted(name) if line.startswith(kinds)}
        assert ran == docs, (
            f"{name} quotes {sorted(docs - ran)}; the demo prints {sorted(ran - docs)}"
        )


def _tg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120
    )


def test_the_commands_the_output_suggests_work(demo_run) -> None:
    """The last line says `trainguard report RUN`; docs/demo.md lists the rest."""
    out, proc = demo_run
    assert proc.stdout.rstrip().endswith(f"(trainguard report {out})"), proc.stdout[-300:]
    rep = _tg("report", str(out))
    assert rep.returncode == 0, rep.stderr
    assert rep.stdout == (out / "report.txt").read_text()
    listed = _tg("events", str(out), "--kind", "fault")
    assert listed.returncode == 0 and " fault " in listed.stdout, listed.stdout + listed.stderr
    assert listed.stdout == _tg("events", str(out / "events"), "--kind", "fault").stdout
    local = _tg("ckpt", "ls", str(out / "local"))
    assert local.returncode == 0, local.stderr
    rows = [line.split() for line in local.stdout.splitlines()[1:]]
    assert rows and all(
        r[0].startswith("node") and "/iter_" in r[0] and r[1] == "local" for r in rows
    )
    assert _tg("ckpt", "verify", str(out / "local")).returncode == 0
    disk = _tg("ckpt", "verify", str(out / "ckpt"))
    assert disk.returncode == 0, disk.stdout  # an uncommitted save the kill cut is no problem
