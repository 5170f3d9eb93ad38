"""A script that ends without closing its checkpointers ends (its writers do not keep it).

The writer process ignores SIGTERM (a preemption signals every process of the job and the
writer must finish the last save), so multiprocessing's exit handler, which SIGTERMs daemonic
children and joins them, used to wait for it forever: a training script that raised before
``close()`` never exited.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import sys
from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager
from trainguard.checkpoint.dcp import StorageWriter

writers = [AsyncCheckpointer(), LocalCheckpointManager(sys.argv[1] + "/local"),
           StorageWriter(sys.argv[1] + "/dcp")]
print(" ".join(str(p) for p in _pids()), flush=True)
raise RuntimeError("the training script failed before close()")
"""

PIDS = """
def _pids():
    import os
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == me:
                out.append(int(entry))
    return out
"""


def test_a_script_that_never_closes_its_checkpointers_exits(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PIDS + SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1, done.stderr
    assert "the training script failed before close()" in done.stderr
    assert time.monotonic() - start < 60
    children = [int(p) for p in done.stdout.split()]
    assert children, done.stdout  # the writers were running
    time.sleep(0.5)
    assert [p for p in children if _running(p)] == []


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for this container's init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"
