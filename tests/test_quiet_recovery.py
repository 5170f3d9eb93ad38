"""Quiet success: a recovered fault is one line at the default log level (issue 41, item 9).

``examples/restart_plain.py`` run as its docstring says (3 ranks, rank 1 raises once, every
rank restarts and restores from memory): before, the surviving ranks' local checkpoint thread
reported the cut save on the round's shut store connections, and torch printed a C++ stack trace
(``frame #N`` lines) for each call, then trainguard's ``reporting iteration N to the store
failed: Broken pipe``; the short clique's warning came once per round.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainguard._errtext import brief

ROOT = Path(__file__).resolve().parents[1]


def test_restart_plain_prints_one_line_per_fault() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "examples/restart_plain.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "round 1: finished 20 steps" in out, out
    assert "frame #" not in out, out
    assert "Broken pipe" not in out and "to the store failed" not in out, out
    assert out.count("fault in round 0") == 1, out
    assert out.count("replication cliques smaller than factor 2") == 1, out  # not per round
    assert "local checkpoint of iteration" not in out, out  # the cut save: at debug level


def test_brief_cuts_a_cpp_backtrace() -> None:
    text = (
        "DistBackendError: [../gloo/pair.cc:553] Connection closed by peer\n"
        "Exception raised from recvBytes at Utils.hpp:758 (most recent call first):\n"
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)\n"
        "frame #1: <unknown function> + 0x6747a52 (0x7f in libtorch_cpu.so)\n"
        "<omitting python frames>\n"
        "frame #18: <unknown function> + 0x891f5 (0x7f in libc.so.6)\n"
    )
    short = brief(text)
    assert short.startswith("DistBackendError: [../gloo/pair.cc:553] Connection closed by peer")
    assert "frame #" not in short and "Exception raised from" not in short
    assert short.endswith("[C++ stack trace at debug level]")
    assert brief("RuntimeError: plain") == "RuntimeError: plain"
