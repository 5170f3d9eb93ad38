"""Quarantine on emulated hosts: three hosts (network namespaces with their own host names),
one rank each, two active. The second host's rank raises whenever it is active: after its
second fault the host is quarantined, the spare on the third host takes its rank number and
the job completes at full active size; the quarantine file names the host."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster
from trainguard.events import read_events

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]


def test_a_flaky_host_is_quarantined_and_a_spare_on_another_host_takes_its_place(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(3)
    out, events = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    env = dict(
        os.environ,
        WORLD_SIZE="3",
        MASTER_ADDR=c.hosts[0].name,
        MASTER_PORT="29500",
        TRAINGUARD_JOB_SECRET=uuid.uuid4().hex,
        TRAINGUARD_EVENTS_DIR=str(events),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    )
    env.pop("TRAINGUARD_HOST_NAME", None)  # each host's own name
    procs = {}
    for rank, host in enumerate(c.hosts):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": "0"}
        argv = [sys.executable, str(ROOT / "tests/cluster/_quarantine_rank.py"), str(out)]
        procs[rank] = c.start(host, argv, log=tmp_path / f"rank{rank}.log", env=rank_env)
    for rank, proc in procs.items():
        assert proc.wait(120) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(3)]
    assert results[1] == {"rounds": [0, 1], "value": None}  # h2: never active again
    assert results[0]["value"] == {"round": 2, "rank": 0, "sum": 2}
    assert results[2]["value"] == {"round": 2, "rank": 1, "sum": 2}  # h3's spare, h2's number
    assert (out / "exclude").read_text() == "h2\n"
    seen = read_events(events)
    blamed = [(e["fault_host"], e["counted"]) for e in seen if e["kind"] == "fault_attributed"]
    assert blamed == [("h2", True), ("h2", True)], blamed
    taken = [e for e in seen if e["kind"] == "host_quarantined"]
    assert [e["quarantined_host"] for e in taken] == ["h2"], taken
