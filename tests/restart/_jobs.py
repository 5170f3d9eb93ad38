"""Rank functions for the restart tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests._dist import live_processes

DIM = 4


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 7 * rank + world)
    x = torch.randn(8, DIM, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True) * 0.5 + 1.0
    return x, y


def reference(
    steps: int, world: int, *, lr: float = 0.1, switch: int | None = None, after: int | None = None
) -> list[float]:
    """The fault-free result, computed in one process (each step: the mean of the ranks'
    gradients). Steps from ``switch`` on run on ``after`` ranks instead of ``world``."""
    w = torch.zeros(DIM + 1, dtype=torch.float64)
    for step in range(steps):
        n = after if after is not None and switch is not None and step >= switch else world
        grads = [_grad(w, *batch(step, rank, n)) for rank in range(n)]
        w = w - lr * torch.stack(grads).sum(0) / n
    return w.tolist()


def _grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w = w.clone().requires_grad_(True)
    pred = x @ w[:DIM].unsqueeze(1) + w[DIM]
    loss = ((pred - y) ** 2).mean()
    loss.backward()
    assert w.grad is not None
    return w.grad.detach()


def sgd_steps(
    call: tr.CallWrapper,
    history: dict[int, torch.Tensor],
    steps: int,
    *,
    lr: float = 0.1,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """The body of the tests' training function, on the round's initialized process group.

    Resumes from the newest step that every rank has in ``history`` (in-memory checkpoints of
    the last few steps, kept across rounds by the caller), then runs the remaining steps with
    one all_reduce each; ``before_step(step)`` may inject a fault. Destroys the process group
    and returns the weights."""
    latest = torch.tensor([max(history) if history else -1], dtype=torch.int64)
    dist.all_reduce(latest, op=dist.ReduceOp.MIN)
    start = int(latest.item())
    w = history[start].clone() if start >= 0 else torch.zeros(DIM + 1, dtype=torch.float64)
    for step in range(start + 1, steps):
        if before_step is not None:
            before_step(step)
        g = _grad(w, *batch(step, call.rank, call.world_size))
        dist.all_reduce(g)
        with call.atomic():
            w = w - lr * g / call.world_size
            history[step] = w.clone()
            for old in [s for s in history if s < step - 3]:
                del history[old]
        call.ping()
    dist.destroy_process_group()
    return w.tolist()


def train_job(
    steps: int,
    fault_rank: int | None,
    fault_step: int,
    lr: float = 0.1,
    fault_rounds: int = 1,
    events_dir: str | None = None,
) -> dict[str, Any]:
    """Train a tiny model with one all_reduce per step; rank ``fault_rank`` raises at step
    ``fault_step`` in each of the first ``fault_rounds`` rounds. Checkpoints are kept in memory
    (last few steps); after a restart the ranks agree on the newest step all of them have."""
    if events_dir:
        from trainguard import events

        events.configure(events_dir)
    history: dict[int, torch.Tensor] = {}
    rounds: list[dict[str, Any]] = []

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> list[float]:
        dist.init_process_group("gloo")
        rounds.append(
            {"round": call.round, "rank": dist.get_rank(), "world": dist.get_world_size()}
        )

        def fault(step: int) -> None:
            if call.initial_rank == fault_rank and step == fault_step and call.round < fault_rounds:
                raise ValueError(f"injected fault at step {step}")

        return sgd_steps(call, history, steps, lr=lr, before_step=fault)

    result = train()
    return {"weights": result, "rounds": rounds, "env_rank": os.environ.get("RANK")}


def blocked_job(marker_dir: str) -> dict[str, Any]:
    """Rank 1 raises while rank 0 waits in all_reduce for it; reports how fast rank 0 got out."""
    out: dict[str, Any] = {}

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> None:
        dist.init_process_group("gloo")
        t = torch.ones(16)
        dist.all_reduce(t)  # everyone is connected
        if call.round == 0:
            if call.rank == 1:
                time.sleep(0.5)  # rank 0 (and 2) are surely blocked in the next all_reduce
                out["raised_at"] = time.time()
                raise RuntimeError("rank 1 fails while the others wait for it")
            try:
                dist.all_reduce(t)
            finally:
                out["released_at"] = time.time()
        else:  # the round's own store, for users who pass store= themselves
            call.store.set(f"user/{call.rank}", f"round {call.round}")
            out["store"] = call.store.get(f"user/{(call.rank + 1) % call.world_size}").decode()
        dist.destroy_process_group()

    train()
    Path(marker_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))
    return out


def resources() -> dict[str, Any]:
    fds = os.listdir("/proc/self/fd")
    sockets = sum(1 for fd in fds if os.path.islink(f"/proc/self/fd/{fd}") and _is_socket(fd))
    import logging

    handlers = sum(
        len(lg.handlers)
        for lg in logging.Logger.manager.loggerDict.values()
        if isinstance(lg, logging.Logger)
    )
    children = _children()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "sockets": sockets,
        "handlers": handlers + len(logging.getLogger().handlers),
        "children": children,
    }


def _is_socket(fd: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def _children() -> list[int]:
    me = os.getpid()
    return [pid for pid, fields in live_processes().items() if int(fields[1]) == me]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def leak_job(faulted_rounds: int, coord_port: int) -> dict[str, Any]:
    """``faulted_rounds`` rounds in a row end with a fault (rank round % world raises); the
    last round completes. Records resources and the store's key count at every round."""
    import logging
    import socket

    from trainguard.coord.store import connect

    before = resources()
    per_round: list[dict[str, Any]] = []
    old_ports: list[int] = []
    probes: list[Any] = []  # a client of the coordination store, made once it is up

    def record(call: tr.CallWrapper) -> None:
        if not probes:
            probes.append(connect("127.0.0.1", coord_port, timeout=30))
        info = {
            "round": call.round,
            "keys": probes[0].num_keys(),
            "os_threads": _os_threads(),
            **resources(),
        }
        old_ports.append(int(os.environ["MASTER_PORT"]))
        if len(old_ports) >= 3:  # round n-2's store must be gone
            with socket.socket() as s:
                info["old_store_refused"] = s.connect_ex(("127.0.0.1", old_ports[-3])) != 0
        per_round.append(info)

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60, max_rounds=faulted_rounds + 1)
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        t = torch.ones(8)
        dist.all_reduce(t)
        with call.atomic():
            record(call)
        # Every rank has recorded before the victim raises: an abort during a record would
        # close the group's sockets under it and the count would depend on timing.
        dist.barrier()
        if call.round < faulted_rounds and call.rank == call.round % call.world_size:
            raise ValueError(f"fault in round {call.round}")
        if call.round < faulted_rounds:
            dist.all_reduce(t)  # blocks until the abort releases it
            raise AssertionError("the collective was not aborted")
        dist.destroy_process_group()
        return call.round

    result = train()
    probes.clear()
    after = resources()
    return {
        "result": result,
        "before": before,
        "after": after,
        "rounds": per_round,
        "handlers": logging.getLogger("trainguard").handlers,
    }


class Unhealthy(Exception):
    pass


def spares_job(unhealthy_rank: int) -> dict[str, Any]:
    """4 processes, at most 3 active. ``unhealthy_rank`` raises in rounds 0 and 1; its health
    check fails after round 1, so round 2 takes the spare in."""
    seen: list[tuple[int, int | None, int]] = []

    def health(state: tr.RoundState) -> None:
        if state.initial_rank == unhealthy_rank and state.round == 1 and state.faults:
            raise Unhealthy("health check failed after round 1")

    @tr.Wrapper(
        rank_filter=tr.MaxActiveWorldSize(3),
        health_check=health,
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> tuple[int, int]:
        dist.init_process_group("gloo")
        seen.append((call.round, call.rank, call.world_size))
        t = torch.tensor([float(call.initial_rank)])
        dist.all_reduce(t)
        if call.initial_rank == unhealthy_rank and call.round < 2:
            raise ValueError(f"fault in round {call.round}")
        dist.all_reduce(t)
        dist.destroy_process_group()
        return call.round, int(t.item())

    return {"result": train(), "seen": seen}


def interrupt_job() -> str:
    """Rank 2 raises KeyboardInterrupt while the others loop over all_reduce."""

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("gloo")
        t = torch.ones(4)
        for step in range(1000):
            if call.initial_rank == 2 and step == 3:
                raise KeyboardInterrupt
            dist.all_reduce(t)
        return "finished"

    result: str = train()
    return result


def grad_mode_job() -> list[bool]:
    """Round 0 ends with autograd switched off in the training thread (as an abort that lands
    inside an optimizer step's no-grad section leaves it); each round reports the mode it
    starts with and round 1 trains."""
    seen: list[bool] = []

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> list[bool]:
        seen.append(torch.is_grad_enabled())
        if call.round == 0:
            torch.set_grad_enabled(False)
            raise ValueError("round 0 unwinds with autograd off")
        w = torch.ones(3, requires_grad=True)
        (w * 2).sum().backward()  # fails with gradients off
        return seen

    result: list[bool] = train()
    return result


def swallow_job() -> dict[str, Any]:
    """Rank 1 faults in round 0; rank 0 catches the restart interrupt and returns."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("trainguard")
    logger.addHandler(handler)
    try:

        @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
        def train(call: tr.CallWrapper) -> int:
            if call.round == 0 and call.initial_rank == 1:
                raise ValueError("fault")
            if call.round == 0:
                try:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        time.sleep(0.01)
                except BaseException:
                    pass  # the mistake under test
            return call.round

        result = train()
    finally:
        logger.removeHandler(handler)
    return {"result": result, "messages": messages}


def slow_connect_at_end_job(hang_s: float) -> dict[str, Any]:
    """A wrapped call whose next round's store client, made ahead by the pre-connect thread,
    hangs ``hang_s`` in its connect (as torch's client retries a store that closed as the job
    ended); the function returns at once. Returns the world size and the seconds the wrapper
    took to return after the function did."""
    import trainguard.restart._preconnect as pre

    def hanging(host: str, port: int, *, timeout: float, gave_up: Any = None) -> Any:
        time.sleep(hang_s)  # a real hang, in the thread that connects ahead, then it fails
        raise ConnectionResetError(f"simulated: {host}:{port} closed while connecting")

    pre.connect = hanging  # type: ignore[attr-defined]
    returned: list[float] = []

    @tr.Wrapper(soft_timeout=2.0, hard_timeout=3.0, store_timeout=30, barrier_timeout=60)
    def train(call: tr.CallWrapper) -> int:
        time.sleep(0.5)  # the pre-connect thread is in its connect by then
        returned.append(time.monotonic())
        return call.world_size

    world = train()
    return {"world": world, "after_return_s": time.monotonic() - returned[0]}


def store_start_job() -> dict[str, Any]:
    """Enter a wrapped call; report how it failed and after how long (rank 0's store process
    cannot start in the test that runs this)."""
    start = time.monotonic()

    @tr.Wrapper(barrier_timeout=60, store_timeout=60)
    def train(call: tr.CallWrapper) -> None:
        raise AssertionError("the wrapped function ran without a store")

    try:
        train()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "error": str(exc),
            "seconds": time.monotonic() - start,
            "at": time.time(),
        }
    raise AssertionError("the wrapped call returned")
