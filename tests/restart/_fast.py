"""Rank functions of test_fast_restart.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
import trainguard.restart._run as run_module
from tests.restart._jobs import resources


def connections_to(port: int) -> int:
    """How many of this process's TCP sockets are connected to 127.0.0.1:``port``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                host, peer_port = sock.getpeername()[:2]
        except (OSError, ValueError, TypeError):
            continue  # closed meanwhile, not connected, or not an IP socket
        count += str(host).removeprefix("::ffff:") == "127.0.0.1" and peer_port == port
    return count


SETTLE_S = 5.0  # far longer than a restart takes: an abort that waits it is seen at once


def blocked_rank_job() -> dict[str, Any]:
    """4 ranks; in round 0 rank 0 raises while every other rank waits in C++ on a peer that is
    waiting too (rank 1 in an all_reduce of the group [1, 2]; ranks 2 and 3 each in a recv from
    the other), so that only its own abort can release it. The monitor's ``settle_s`` is
    raised to :data:`SETTLE_S`. Records per round the time of entry and of the fault, and this
    process's connections to the round's store before and after ``init_process_group``."""
    run_module.Monitor = functools.partial(run_module.Monitor, settle_s=SETTLE_S)  # type: ignore[misc]
    before = resources()
    seen: dict[str, Any] = {"enter": {}, "fault": None, "before_init": {}, "after_init": {}}

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> int:
        seen["enter"][call.round] = time.time()
        seen["before_init"][call.round] = connections_to(int(os.environ["MASTER_PORT"]))
        dist.init_process_group("gloo")
        seen["after_init"][call.round] = connections_to(int(os.environ["MASTER_PORT"]))
        t = torch.ones(4)
        if call.round == 0:
            pair = dist.new_group([1, 2])
            dist.all_reduce(t)
            if call.rank == 0:
                time.sleep(0.5)  # every other rank is blocked by now
                seen["fault"] = time.time()
                raise RuntimeError("injected")
            if call.rank == 1:
                dist.all_reduce(t, group=pair)  # rank 2 never joins
            else:
                dist.recv(t, src=5 - call.rank)  # 2 <-> 3: neither ever sends
        dist.all_reduce(t)
        dist.destroy_process_group()
        return call.round

    rounds = train()
    return {**seen, "rounds": rounds, "before": before, "after": resources()}
