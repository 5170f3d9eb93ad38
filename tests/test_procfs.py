"""trainguard._procfs: a process's stat line, read for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from trainguard import _procfs


def test_parent_and_state_of_a_real_process_and_none_once_it_is_gone() -> None:
    # a command name with spaces and parentheses: the fields are taken after the last ")"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], executable=sys.executable
    )
    try:
        assert _procfs.parent_of(proc.pid) == os.getpid()
        assert _procfs.parent_of(os.getpid()) == os.getppid()
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _procfs.state_of(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _procfs.state_of(proc.pid) == "T"
        os.kill(proc.pid, signal.SIGCONT)
        while _procfs.state_of(proc.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _procfs.state_of(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
    assert _procfs.state_of(proc.pid) is None
    assert _procfs.stat_fields(proc.pid) is None


def test_a_command_name_with_spaces_and_parentheses_is_skipped_whole(tmp_path) -> None:
    odd = tmp_path / "a b) (c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "30"])
    try:
        fields = _procfs.stat_fields(proc.pid)
        assert fields is not None and fields[0] in (b"S", b"R")
        assert _procfs.parent_of(proc.pid) == os.getpid()
    finally:
        proc.kill()
        proc.wait()


def test_descendants_are_children_and_grandchildren_not_siblings() -> None:
    # a child that starts a grandchild and prints its pid; a sibling that is no descendant
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        "print(p.pid, flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert sorted(_procfs.descendants(child.pid)) == [grandchild]
        found = _procfs.descendants(os.getpid())
        assert {child.pid, grandchild, other.pid} <= set(found)
        assert _procfs.descendants(other.pid) == []
    finally:
        for proc in (child, other):
            proc.kill()
            proc.wait()
        child.stdout.close()  # type: ignore[union-attr]
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(grandchild, signal.SIGKILL)
