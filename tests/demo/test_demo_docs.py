"""The demo's output quoted in the README and docs/demo.md matches what the demo prints.

The quotes come from a real run (``python bench/demo_transcript.py`` writes them); these checks
fail when the demo's default schedule, its fault lines, its recovery lines or its closing lines
change without the quotes following: the fault lines must be the default schedule's, rendered
by the demo's own line functions, in order; each recovery line must be what the demo's
function renders for it (timings masked) and resume where its fault struck (live state, 0 steps
recomputed). tests/demo/test_demo.py checks the same line shapes against a real run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainguard.demo import faults, runner
from trainguard.demo._run import finished_line, injected_line, recovery_line

ROOT = Path(__file__).resolve().parents[2]
QUOTES = {
    "README.md": "<!-- fragment: output of trainguard demo -->",
    "docs/demo.md": "<!-- fragment: output of make demo -->",
}
_RECOVERY = re.compile(
    r"^  > round (\d+): (\d+) ranks training again (\d+\.\d\d) s after the fault, resumed at step "
    r"(\d+) from (.+), (\d+) steps recomputed$"
)
_FINISHED = re.compile(r"^guarded run finished: (\d+) steps, (\d+) faults, (\d+) recoveries, "
                       r"(\d+) steps recomputed, (\d+\.\d) s$")  # fmt: skip


def quoted(name: str) -> list[str]:
    """The lines of the fenced block after the quote's marker in ``name``."""
    text = (ROOT / name).read_text()
    mark = QUOTES[name]
    assert mark in text, f"{name} lost its quote of the demo's output ({mark})"
    block = text.split(mark + "\n```text\n", 1)[1].split("\n```\n", 1)[0]
    return block.splitlines()


def default_schedule() -> tuple[faults.Fault, ...]:
    return faults.parse(faults.DEFAULT_SCHEDULE, ranks=4, spares=1, steps=300)


def shape(line: str) -> str:
    """A line with every number masked: what two runs of the same code print alike."""
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"sha256 [0-9a-f]+", "sha256 H", line))


@pytest.mark.parametrize("name", sorted(QUOTES))
def test_quoted_faults_are_the_default_schedule(name: str) -> None:
    lines = quoted(name)
    expected, rnd = [], 0
    for fault in default_schedule():  # a straggler is no fault that restarts the round
        expected.append(injected_line(fault.kind, fault.rank, fault.step, rnd))
        rnd += fault.kind != "slow"
    assert [line for line in lines if line.startswith("  ! ")] == expected, name


@pytest.mark.parametrize("name", sorted(QUOTES))
def test_quoted_recoveries_are_the_demos_lines(name: str) -> None:
    lines = quoted(name)
    restarting = [f for f in default_schedule() if f.kind != "slow"]
    recoveries = [line for line in lines if line.startswith("  > round")]
    assert len(recoveries) == len(restarting), recoveries
    for n, (line, fault) in enumerate(zip(recoveries, restarting, strict=True), 1):
        m = _RECOVERY.match(line)
        assert m, f"{name}: {line!r} is not a recovery line"
        rnd, world, took, first, source, lost = m.groups()
        again = recovery_line(int(rnd), int(world), float(took), int(first), source, int(lost))
        assert line == again, f"{name}: the demo now prints {again!r}"
        # live state first (the default): every fault resumes where it struck
        assert (int(rnd), int(world), int(first), int(lost)) == (n, 4, fault.step, 0), line
        assert source.startswith("live state"), line
    (end,) = [line for line in lines if line.startswith("guarded run finished:")]
    m = _FINISHED.match(end)
    assert m, end
    steps, n_faults, n_recoveries, recomputed, wall = m.groups()
    assert end == finished_line(
        int(steps), int(n_faults), int(n_recoveries), int(recomputed), float(wall)
    )
    assert (int(steps), int(n_faults), int(n_recoveries), int(recomputed)) == (
        300, len(default_schedule()), len(restarting), 0,
    )  # fmt: skip
    assert lines[-1].startswith("bit-identical: yes") or any(
        line.startswith("bit-identical: yes") for line in lines
    )


def test_the_whole_transcript_names_the_default_settings() -> None:
    lines = quoted("docs/demo.md")
    labels = ", ".join(f.label for f in default_schedule())
    assert lines[0].startswith("trainguard demo: 4 ranks + 1 spare(s), 300 steps"), lines[0]
    assert lines[0].endswith(f"; faults: {labels}"), lines[0]
    assert not [line for line in lines if "] step " in line], "progress bars are left out"


def test_help_lists_every_fault_kind() -> None:
    """`trainguard demo --help` names every kind --faults takes (the default uses `slow`)."""
    for kind in faults.KINDS + faults.ENDING:
        assert re.search(rf"^  {kind} +\S", runner._KINDS_HELP, re.M), kind
