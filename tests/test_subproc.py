"""The helper interpreters' entry points run without runpy's double-import warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("module", ["trainguard.restart.sidecar", "trainguard.coord._server"])
def test_entry_point_is_not_imported_before_it_runs(module: str) -> None:
    # An unreadable configuration: the module starts, fails at once, and says so.
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", module],
        input=b"{}\n",
        capture_output=True,
        timeout=120,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert b"found in sys.modules" not in proc.stderr, proc.stderr.decode()
    assert proc.returncode == 1 and b"KeyError" in proc.stdout + proc.stderr, proc
