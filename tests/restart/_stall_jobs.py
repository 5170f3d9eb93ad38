"""Rank functions for the tests of a group constructor stalled by a peer (module level, for
the rank processes): the live-state job of tests/live/_jobs.py, where one rank stops itself
right after publishing its gloo address."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.live._jobs import TIMEOUTS, InjectedFault, _claim, _clone, digest, make, step_once


class StopAfterAddress(dist.Store):
    """A store that, at gloo's address key, publishes this rank's address with its port made
    65535 (so every peer waits for this rank to connect: gloo's higher address connects),
    stops the process (SIGSTOP) for ``stop_s`` seconds and then fails the construction, as
    a peer that aborted its half-built group: nobody ever connects to the waiting peer. Its
    keys get the prefix that ``init_process_group`` gives a store it makes (``env://``) and
    not one it is given, so that they meet the other ranks'."""

    PREFIX = "default_pg/"

    def __init__(self, store: Any, stop_s: float) -> None:
        super().__init__()
        self._s = store
        self._stop_s = stop_s

    def set(self, key: str, value: Any) -> None:
        data = bytes(value)
        if "cpu" not in key:
            self._s.set(self.PREFIX + key, data)
            return
        (name,) = struct.unpack_from("<Q", data, 0)
        at = 8 + name + 8  # hostname, then the address (a sockaddr: family, port, ...)
        self._s.set(self.PREFIX + key, data[: at + 2] + struct.pack(">H", 65535) + data[at + 4 :])
        subprocess.Popen(["/bin/sh", "-c", f"sleep {self._stop_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        raise InjectedFault("injected: this rank dropped its group after publishing its address")

    def get(self, key: str) -> Any:
        return self._s.get(self.PREFIX + key)

    def add(self, key: str, n: int) -> int:
        return int(self._s.add(self.PREFIX + key, n))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = [self.PREFIX + k for k in keys]
        if timeout is None:
            self._s.wait(keys)
        else:
            self._s.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._s.check([self.PREFIX + k for k in keys]))

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        return self._s.compare_set(self.PREFIX + key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return bool(self._s.delete_key(self.PREFIX + key))

    def num_keys(self) -> int:
        return int(self._s.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._s.set_timeout(timeout)


def stall_job(steps: int, at: int, out_dir: str, abort_timeout: float) -> dict[str, Any]:
    """3 ranks, 2 active (``MaxActiveWorldSize(2)``): initial rank 1 is SIGKILLed at step
    ``at`` of round 0, so in the next round only initial rank 0 holds live state, and the
    spare (initial rank 2) that takes the gap stops itself in its first
    ``init_process_group`` right after publishing its address, then fails it. A fallback
    starts again from step 0 (no checkpoint here). Returns the digest and every round's
    recovery."""
    import trainguard.restart as tr
    from trainguard import events
    from trainguard.live import LiveState

    events.configure(out_dir)
    net, opt = make()
    initial = {"model": _clone(net.state_dict()), "optim": _clone(opt.state_dict())}
    live = LiveState(model=net, optimizer=opt)
    recoveries: list[dict[str, Any]] = []
    killed, stopped = Path(out_dir, "fault"), Path(out_dir, "stopped")

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(2),
        **{**TIMEOUTS, "abort_timeout": abort_timeout},
    )
    def train(call: tr.CallWrapper) -> str:
        me = call.state.initial_rank
        if me == 2 and _claim(stopped, call.round):
            store = StopAfterAddress(call.store, 3.0)
            dist.init_process_group("gloo", store=store, rank=call.rank, world_size=call.world_size)
        else:
            dist.init_process_group("gloo")
        got = live.recover()
        first = got.step
        if first is None:
            net.load_state_dict(initial["model"])
            opt.load_state_dict(_clone(initial["optim"]))
            first = 0
            live.restored(0)
        recoveries.append(
            {
                "round": call.round,
                "rank": me,
                "live": got.live,
                "step": got.step,
                "fallback": got.fallback,
                "received_from": got.received_from,
                "recomputed": got.recomputed,
            }
        )
        for step in range(first, steps):
            hit = me == 1 and step == at and _claim(killed, call.round)
            step_once(net, opt, live, step, call.world_size, "kill" if hit else "", call)
            call.ping()
        dist.destroy_process_group()
        return digest(net)

    return {"digest": train(), "recoveries": recoveries}


def connect_wait_job(timeout_s: float, stop_s: float) -> dict[str, Any]:
    """Rank 1 publishes its address (``StopAfterAddress``), stops for ``stop_s`` seconds and
    drops its group; rank 0 builds the group with ``timeout_s`` and reports how long its
    constructor waited and what it raised."""
    import time

    if int(os.environ["RANK"]) == 1:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=60),
        )
        store.set("ready", b"1")
        try:
            dist.init_process_group(
                "gloo", store=StopAfterAddress(store, stop_s), rank=1, world_size=2
            )
        except Exception as exc:
            return {"raised": type(exc).__name__}
        return {"raised": None}
    server = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    server.wait(["ready"])  # rank 1 is there before the timed part starts
    store = dist.PrefixStore("default_pg", server)
    start = time.monotonic()
    try:
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=timeout_s)
        )
    except Exception as exc:
        return {"waited": time.monotonic() - start, "raised": str(exc)[:300]}
    return {"waited": time.monotonic() - start, "raised": None}


def restored_timeout_job(late_s: float) -> dict[str, Any]:
    """A gloo group built with a 1 s timeout, then given 30 s (``set_group_timeout``), and a
    second one left at 1 s: rank 1 comes ``late_s`` seconds late to an all-reduce on each."""
    import time

    import torch

    from trainguard import _torchcompat

    dist.init_process_group("gloo", timeout=timedelta(seconds=1))
    _torchcompat.set_group_timeout(dist.group.WORLD, timedelta(seconds=30))
    short = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    out: dict[str, Any] = {}
    for name, group in (("restored", None), ("short", short)):
        if dist.get_rank() == 1:
            time.sleep(late_s)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            out[name] = None
        except Exception as exc:
            out[name] = type(exc).__name__
        out[f"{name}_s"] = time.monotonic() - start
    return out
