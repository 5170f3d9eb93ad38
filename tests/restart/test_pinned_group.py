"""A round's default group is not pinned for the life of the process by a torch module that
reads ``group.WORLD`` at import time (torch.distributed.nn.functional, which the first
``optimizer.step()`` imports through torch._dynamo)."""

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
