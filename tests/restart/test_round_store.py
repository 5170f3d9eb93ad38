"""A rank blocked on the round's store when another rank's fault aborts the round.

A wait on a TCPStore (a checkpointer's gather, the rendezvous inside a process group's
constructor) blocks in C++, where the restart interrupt cannot land. The abort shuts down the
rank's connections to the round's store, so the wait raises at once and the rank goes on to
the next round; before, it stayed blocked until ``abort_timeout``, was declared stuck and its
process ended (the soak lost three ranks that way after one false hang).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests._dist import run_ranks
from tests.restart._faults import TIMEOUTS


def blocked_rank_job(where: str, out_dir: str) -> dict[str, Any]:
    """Round 0: rank 1 blocks on the round's store (``where``), rank 0 raises. Round 1: both
    all_reduce and return."""
    rounds: list[tuple[int, float]] = []
    marker = Path(out_dir, "fault")

    @tr.Wrapper(**{**TIMEOUTS, "soft_timeout": 60.0, "hard_timeout": 120.0})
    def train(call: tr.CallWrapper) -> float:
        rounds.append((call.round, time.time()))
        if call.round == 0 and call.rank == 0:
            if where == "wait":
                dist.init_process_group("gloo")
            time.sleep(1.0)  # rank 1 is blocked by now
            marker.write_text(repr(time.time()))
            raise RuntimeError("fault on rank 0")
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        if call.round == 0:  # rank 1; "init" blocked in the constructor above already
            store = dist.distributed_c10d._get_default_store()
            store.wait(["never-set"], timedelta(seconds=60))
            raise AssertionError("the wait returned")
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return float(t[0])

    value = train()
    return {"value": value, "rounds": rounds, "pid": os.getpid()}


@pytest.mark.parametrize("where", ["wait", "init"])
def test_a_rank_blocked_on_the_round_store_restarts_with_the_others(where: str, tmp_path) -> None:
    results = run_ranks(blocked_rank_job, 2, args=(where, str(tmp_path)), timeout=120)
    fault = float((tmp_path / "fault").read_text())
    for r in results:
        value = r.get()  # before the fix rank 1 was declared stuck and its process ended
        assert value["value"] == 2.0
        assert [n for n, _ in value["rounds"]] == [0, 1]
        latency = value["rounds"][1][1] - fault
        # abort_timeout is 5 s: a rank that re-entered sooner was never declared stuck
        assert 0 < latency < 4.0, f"rank {r.rank} re-entered {latency:.2f} s after the fault"
