"""Nothing keeps a round's process group alive after the Wrapper returns or raises: not a
torch module that reads ``group.WORLD`` at import time (torch.distributed.nn.functional, which
the first ``optimizer.step()`` imports through torch._dynamo), not the restart interrupt's
traceback (whose frames hold the collective's ``group``)."""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests._dist import run_ranks
from trainguard.errors import RetryLimitError

_MODULE = "torch.distributed.nn.functional"


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
    return out


def import_in_round_job() -> dict[str, Any]:
    imported_before = _MODULE in sys.modules
    before = _fds()

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> None:
        dist.init_process_group("gloo")
        importlib.import_module(_MODULE)  # first imported while the round's group exists
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.destroy_process_group()

    train()
    time.sleep(0.2)
    gc.collect()
    after = _fds()
    left = {fd: target for fd, target in after.items() if before.get(fd) != target}
    return {"imported_before": imported_before, "left": left}


def test_a_module_imported_in_a_round_does_not_keep_its_group() -> None:
    results = [r.get() for r in run_ranks(import_in_round_job, 2, timeout=120)]
    for res in results:
        assert not res["imported_before"]  # the scenario: imported during the round
        assert res["left"] == {}, res["left"]  # no store connection, no gloo transport left


def interrupted_then_ended_job() -> dict[str, Any]:
    """Rank 1 raises while rank 0 waits in all_reduce (interrupted); max_rounds=1 ends the
    job, so the Wrapper raises on both."""
    importlib.import_module(_MODULE)  # not the import's doing: that is the test above
    before = _fds()

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60, max_rounds=1)
    def train(call: tr.CallWrapper) -> None:
        dist.init_process_group("gloo")
        t = torch.ones(4)
        dist.all_reduce(t)  # connected
        if call.rank == 1:
            time.sleep(0.3)  # rank 0 is surely waiting in the next all_reduce
            raise ValueError("rank 1 fails")
        dist.all_reduce(t)

    ended = ""
    try:
        train()
    except RetryLimitError as exc:
        ended = str(exc)
    time.sleep(0.2)
    gc.collect()
    after = _fds()
    left = {fd: target for fd, target in after.items() if before.get(fd) != target}
    return {"ended": ended, "left": left}


def test_a_wrapper_that_raised_keeps_no_group_of_its_rounds() -> None:
    results = [r.get() for r in run_ranks(interrupted_then_ended_job, 2, timeout=120)]
    for res in results:
        assert "max_rounds=1" in res["ended"], res
        assert res["left"] == {}, res["left"]
