"""Node liveness on emulated hosts (:mod:`trainguard.coord.node_ring`): two hosts
of two ranks each, a node watcher on each, a real store on the first. The second host's watcher is
stopped (SIGSTOP; its pid from its ranks' handshakes, never found by scanning): the first
host's watcher finds the node's key silent and declares both of its ranks gone; the first
host's ranks go on in a round of 2; no rank of the live host is declared."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster
from trainguard.events import read_events

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]


def _wait(until: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_stopped_node_watcher_gets_every_rank_of_its_node_declared(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(2)
    out, events = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    env = dict(
        os.environ,
        WORLD_SIZE="4",
        MASTER_ADDR=c.hosts[0].name,
        MASTER_PORT="29500",
        TRAINGUARD_JOB_SECRET=uuid.uuid4().hex,
        TRAINGUARD_EVENTS_DIR=str(events),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    )
    procs = {}
    for rank in range(4):
        host = c.hosts[rank // 2]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)}
        argv = [sys.executable, str(ROOT / "tests/cluster/_node_rank.py"), str(out)]
        procs[rank] = c.start(host, argv, log=tmp_path / f"rank{rank}.log", env=rank_env)
    _wait(lambda: all((out / f"watcher-{r}").exists() for r in range(4)), "the handshakes", 90)
    watchers = {r: int((out / f"watcher-{r}").read_text()) for r in range(4)}
    assert watchers[0] == watchers[1] != watchers[2] == watchers[3], watchers
    time.sleep(1.0)  # the watchers beat and judged each other a few times
    os.kill(watchers[2], signal.SIGSTOP)  # the second host's watcher only, by its pid
    try:
        for r in (0, 1):
            assert procs[r].wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    finally:
        c.kill_host(c.hosts[1])  # SIGKILL ends the stopped watcher too
    for r in (0, 1):
        worlds = json.loads((out / f"result-{r}.json").read_text())["worlds"]
        assert worlds[0] == 4 and worlds[-1] == 2, worlds
    gone = [e for e in read_events(events) if e["kind"] == "rank_gone"]
    assert sorted({e["gone_rank"] for e in gone}) == [2, 3], gone
    assert all("its node silent" in str(e.get("cause", "")) for e in gone), gone
