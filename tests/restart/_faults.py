"""Rank functions for the fault tests (deaths, hangs, lost nodes); module level for spawn."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests.restart._jobs import sgd_steps

TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 60,
    "completion_timeout": 60,
    "soft_timeout": 1.0,
    "hard_timeout": 3.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 30.0,
}


def _fault(kind: str, marker: Path) -> None:
    marker.write_text(repr(time.time()))
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(1)
    elif kind == "sleep":  # a hang that releases the GIL
        time.sleep(120)
    elif kind == "spin":  # a hang in Python code: only the missing pings show it
        while True:
            pass
    elif kind == "gil":  # a hang that holds the GIL (catastrophic regex backtracking)
        re.match(r"(a+)+$", "a" * 64 + "b")
    elif kind == "watcher":  # this job's node watcher dies (one job, one host: one watcher)
        (pid,) = watcher_pids(os.environ["TG_TEST_JOB"])
        os.kill(pid, signal.SIGKILL)
        time.sleep(120)
    raise AssertionError(f"fault {kind!r} returned")


def watcher_pids(job: str | None = None) -> list[int]:
    """This user's node watcher processes (detached: no rank is their parent); with ``job``
    (``TG_TEST_JOB`` of tests/_dist.py), only that job's (a watcher inherits the environment
    of the rank that started it; other test runs on this machine have watchers of their own)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
            if b"trainguard.restart.sidecar" not in cmdline:
                continue
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if job is None or f"TG_TEST_JOB={job}".encode() in environ:
            pids.append(int(entry))
    return pids


def child_pid(parent: int, needle: bytes) -> int | None:
    """The child process of ``parent`` whose command line contains ``needle``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and needle in cmdline:
            return int(entry)
    return None


def fault_job(
    steps: int,
    victim: int,
    fault_step: int,
    kind: str,
    out_dir: str,
    overrides: dict[str, Any] | None = None,
    lr: float = 0.1,
    victim_overrides: dict[str, Any] | None = None,
    hold_round: int | None = None,
) -> dict[str, Any]:
    """One all_reduce per step; ``victim`` suffers fault ``kind`` at ``fault_step`` of round 0
    (``victim_overrides``: Wrapper arguments of the victim only). In round ``hold_round`` the
    active ranks wait at step ``fault_step + 1`` until the round is aborted.

    In-memory checkpoints of the last steps; after a restart the ranks resume from the newest
    step they all have. Records each round's (round, rank, world) and when the function was
    entered."""
    from trainguard import events

    events.configure(out_dir)
    history: dict[int, torch.Tensor] = {}
    rounds: list[dict[str, Any]] = []
    marker = Path(out_dir, f"fault-{victim}")

    config = {**TIMEOUTS, **(overrides or {})}
    if int(os.environ["RANK"]) == victim:
        config.update(victim_overrides or {})

    @tr.Wrapper(**config)
    def train(call: tr.CallWrapper) -> list[float]:
        rounds.append(
            {
                "round": call.round,
                "rank": call.rank,
                "world": call.world_size,
                "entered": time.time(),
            }
        )
        dist.init_process_group("gloo")

        def fault(step: int) -> None:
            if call.initial_rank == victim and step == fault_step and call.round == 0:
                _fault(kind, marker)
            while call.round == hold_round and step == fault_step + 1:
                call.ping()  # until the round is aborted (the interrupt ends the wait)
                time.sleep(0.02)

        return sgd_steps(call, history, steps, lr=lr, before_step=fault)

    result = train()
    return {"weights": result, "rounds": rounds}


def mixed_rounds_job(faulted: int) -> dict[str, Any]:
    """``faulted`` rounds in a row end with a fault of a changing kind (an exception, a
    GIL-released hang, a hang in Python code) on a changing rank; then one round completes.
    Records this process's resources at every round."""
    from tests.restart._jobs import _os_threads, resources

    per_round: list[dict[str, Any]] = []
    # Faulted rounds so far. A rank interrupted early in a round (before it counted the round)
    # would count one fewer than the others and pick another victim: the ranks agree on the
    # largest count (MAX) at every round's start.
    count = [0]

    # none of these faults needs the sidecar's kill (each hang is interrupted at the soft
    # timeout): a hard timeout far above it keeps a loaded machine's slow unwind from being
    # killed as a hang, which would end the rank instead of measuring its leaks
    @tr.Wrapper(**{**TIMEOUTS, "hard_timeout": 15.0, "max_rounds": faulted + 10})
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        t = torch.full((8,), float(count[0]))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        done = int(t[0].item())
        if done < faulted:
            count[0] = done + 1  # this round ends with a fault, whatever interrupts this rank
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        per_round.append(
            {
                "round": call.round,
                "os_threads": _os_threads(),
                "fds": len(os.listdir("/proc/self/fd")),
                "rss": rss,
                **resources(),
            }
        )
        # Every rank has recorded before the victim faults: an abort during a record would
        # close the group's sockets under it and the count would depend on timing.
        dist.barrier()
        if done < faulted:
            per_round[-1]["faulted"] = True
            if call.rank == done % call.world_size:
                kind = ("raise", "sleep", "spin")[done % 3]
                if kind == "raise":
                    raise ValueError(f"fault {done}")
                if kind == "sleep":
                    time.sleep(120)
                call.ping()
                while True:
                    pass
            dist.all_reduce(t)  # blocks until the abort releases it
            raise AssertionError("the collective was not aborted")
        dist.destroy_process_group()
        return done

    result = train()
    return {"result": result, "rounds": per_round, "after": resources()}


class _DieAtBarrier:
    """A store client of the victim's session that kills the victim at round 0's barrier:
    after its record and before its count (``before_add``), or after its count, before it
    could lay the round out (``after_add``). The victim arrives last, so that it would be the
    one to publish the round. It arrives by itself (its record appended to the round's pool,
    then its count), as a rank does whose node watcher is gone (:func:`barrier_death_job`)."""

    def __init__(self, store: Any, keys: Any, rank: int, world: int, when: str, marker: Path):
        self._store, self._keys, self._rank, self._world = store, keys, rank, world
        self._when, self._marker = when, marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def append(self, key: str, value: Any) -> Any:
        if key == self._keys.pool(0):
            deadline = time.monotonic() + 60
            while int(self._store.add(self._keys.arrive(0), 0)) < self._world - 1:
                assert time.monotonic() < deadline, "the others did not arrive"
                time.sleep(0.01)
        return self._store.append(key, value)

    def add(self, key: str, amount: int) -> Any:
        if key != self._keys.arrive(0) or amount != 1:
            return self._store.add(key, amount)
        if self._when == "after_add":
            self._store.add(key, amount)
        self._marker.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("still alive")


def barrier_death_job(victim: int, when: str, out_dir: str) -> dict[str, Any]:
    """``victim`` dies inside round 0's barrier (see :class:`_DieAtBarrier`); the others train."""
    if int(os.environ["RANK"]) == victim:
        from trainguard.restart._session import Session

        original, watch = Session.open, Session.watch

        def open_and_trap(self: Any) -> None:
            original(self)
            marker = Path(out_dir, f"fault-{victim}")
            book = self.book  # the barrier's store calls go through the round book
            book.store = _DieAtBarrier(book.store, self.keys, victim, self.world, when, marker)

        def watch_alone(self: Any, helper: Any) -> Any:
            store = watch(self, helper)
            self.node = None  # it arrives by itself, not through its node watcher
            return store

        Session.open = open_and_trap  # type: ignore[method-assign]
        Session.watch = watch_alone  # type: ignore[method-assign]
    # store_timeout as long as the barrier's: a loaded machine starts rank 0's store late
    return fault_job(10, -1, -1, "none", out_dir, {"barrier_timeout": 20, "store_timeout": 20})
