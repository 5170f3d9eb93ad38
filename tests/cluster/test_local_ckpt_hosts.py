"""Local checkpoints replicated across emulated hosts: copies follow the hosts of the round.

Four hosts; a job of 4 ranks (gloo, store on h1, host names and addresses of their own) whose
ranks are laid out as after ``FillGaps`` filled two gaps with the spares of one host: h1 holds
rank 0, h2 rank 2, and h3's two spares took rank 1 (of h1) and rank 3 (of h2). With placement
by rank arithmetic (``jump`` = ``LOCAL_WORLD_SIZE`` = 2 processes per host, as the launcher sets
it) ranks 1 and 3 form a clique, both on h3. Then
h3 dies with its node-local storage, fresh processes on h4 take ranks 1 and 3, and every part
must still load: received over the network from a peer on another host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster, Host

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).with_name("_ckpt_worker.py"))
PORT = 29500  # every host is a network namespace of its own: nothing else listens there


def _run_phase(c: Cluster, tmp: Path, phase: str, placement: dict[int, Host]) -> dict[int, dict]:
    """Start one process per rank on its host, wait for all; each rank's report."""
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for rank, host in placement.items():
        argv = [sys.executable, WORKER, phase, str(rank), str(len(placement)), "h1", str(PORT)]
        argv += [str(host.local / f"rank{rank}"), str(tmp / f"{phase}-{rank}.json")]
        env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}  # 2 processes per host, as launched
        procs[rank] = c.start(host, argv, log=logs / f"{phase}-{rank}.log", env=env)
    codes = {}
    for rank, p in procs.items():
        try:
            codes[rank] = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            codes[rank] = None
    if any(code != 0 for code in codes.values()):
        text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))
        raise AssertionError(f"{phase}: exit codes {codes}\n{text}")
    return {r: json.loads((tmp / f"{phase}-{r}.json").read_text()) for r in placement}


def test_host_with_spares_of_two_hosts_dies_and_every_part_loads(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(4)
    h1, h2, h3, h4 = c.hosts
    saved = _run_phase(c, tmp_path, "save", {0: h1, 1: h3, 2: h2, 3: h3})
    assert [saved[r]["host"] for r in range(4)] == ["h1", "h3", "h2", "h3"]  # real host names
    c.kill_host(h3)
    shutil.rmtree(h3.local)  # h3 is gone, with its node-local storage
    loaded = _run_phase(c, tmp_path, "load", {0: h1, 1: h4, 2: h2, 3: h4})
    assert [loaded[r]["found"] for r in range(4)] == [2] * 4, loaded
    assert all(loaded[r]["equal"] for r in range(4)), loaded
    for r in (1, 3):  # received from a peer on h1 or h2
        source = loaded[r]["source"]
        assert source in ("rank 0", "rank 2"), loaded
    for r in range(4):  # every clique of the save spanned two hosts
        assert len({saved[m]["host"] for m in saved[r]["clique"]}) == 2, saved
