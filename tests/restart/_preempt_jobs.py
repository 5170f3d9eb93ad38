"""Rank function of the preemption tests: a small DDP-like training job (gloo, one gradient
all-reduce per step) under the Wrapper, with a disk checkpoint every ``disk_every`` steps, a
local one every ``local_every``, and the preemption protocol at every step boundary.

Each rank appends ``{"rank", "step", "pid"}`` to ``progress-<rank>.jsonl`` before each step.
It returns the final parameters as a list of floats (the resumed run's must equal a run
without preemption bit for bit); a preempted rank's wrapped function raises ``Preempted``.

``fault_at``: a fault during a preemption, in round 0: during step ``fault_at - 1`` every
rank sends SIGTERM to its process group (itself and its helpers, as a scheduler does); at the
boundary ``fault_at`` rank 0 proposes the stop step (``fault_at + 1``) and rank 1 raises
before it reads it, so round 1 starts before every rank knows the stop step.
``announce``: rank 0 writes the address of its first round's store to ``round-store.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr

DIM = 16


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 97 * step + rank)
    x = torch.randn(32, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.3 - 0.1


def _state(net: torch.nn.Module, opt: torch.optim.Optimizer, done: int) -> dict[str, Any]:
    return {"model": net.state_dict(), "optim": opt.state_dict(), "step": done}


def train_job(
    out: str,
    *,
    steps: int,
    disk_every: int = 10,
    local_every: int = 5,
    step_time: float = 0.02,
    grace: float = 30.0,
    late_rank: int | None = None,
    fault_at: int | None = None,
    announce: bool = False,
) -> list[float]:
    """One rank; resumes from the newest committed disk checkpoint under ``out/ckpt``.
    ``late_rank``: that rank sleeps past the grace budget before it saves the stop step."""
    from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager, latest, load

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    root = Path(out)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "logs" / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)  # everything this process prints: log records, tracebacks
    os.close(fd)
    logging.basicConfig(
        level=logging.INFO, format=f"rank {rank} %(name)s: %(message)s", stream=sys.stderr
    )
    disk = AsyncCheckpointer(commit_timeout=30)
    local = LocalCheckpointManager(root / "local" / f"rank{rank}", timeout=30)

    @tr.Wrapper(
        preemption_grace=grace,
        soft_timeout=20,
        hard_timeout=40,
        heartbeat_interval=0.5,
        heartbeat_timeout=10,
        max_rounds=3,
    )
    def train(call: tr.CallWrapper) -> list[float]:
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        net = torch.nn.Linear(DIM, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        first = 0
        newest = latest(root / "ckpt")
        if newest is not None:
            state = load(newest)
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            first = int(state["step"])
        log = root / f"progress-{call.rank}.jsonl"
        if announce and call.rank == 0 and call.round == 0:
            _announce(root, call)
        for step in range(first, steps):
            if step == fault_at and call.round == 0:
                _fault_during_preemption(call, root, disk, step)
            if call.preempted(step):
                path = root / "ckpt" / f"step_{step:06d}"
                if step % local_every:  # else saved after the step before
                    local.save(_state(net, opt, step), step)
                if call.rank == late_rank:
                    time.sleep(grace * 4)
                if step % disk_every:
                    disk.save(_state(net, opt, step), path)
                local.wait(timeout=call.grace_left())
                disk.wait(timeout=call.grace_left())
                dist.destroy_process_group()
                return []
            with log.open("a") as f:
                f.write(json.dumps({"rank": call.rank, "step": step, "pid": os.getpid()}) + "\n")
            x, y = _batch(step, call.rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            for p in net.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= call.world_size
            opt.step()
            if fault_at is not None and call.round == 0 and step == fault_at - 1:
                os.killpg(0, signal.SIGTERM)  # lands mid-step, as a scheduler's does
            time.sleep(step_time)
            done = step + 1
            if done % local_every == 0:
                local.save(_state(net, opt, done), done)
            if done % disk_every == 0 and done < steps:
                disk.save(_state(net, opt, done), root / "ckpt" / f"step_{done:06d}")
        disk.wait()
        dist.destroy_process_group()
        return [float(v) for p in net.parameters() for v in p.detach().reshape(-1)]

    try:
        return train()
    finally:
        local.close()
        disk.close()


def _fault_during_preemption(call: tr.CallWrapper, root: Path, disk: Any, step: int) -> None:
    """Round 0 at the boundary ``step``, after the SIGTERM: rank 0 proposes the stop step,
    then rank 1 raises without having read it (the stop step is known to rank 0 only)."""
    disk.wait()  # the periodic checkpoint is committed: every rank resumes from it in round 1
    proposed = root / "proposed"
    if call.rank == 0:
        assert not call.preempted(step)  # proposes step + 1
        proposed.touch()
        return  # into the step's all-reduce, which rank 1's fault aborts
    deadline = time.monotonic() + 30
    while not proposed.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError(f"a fault at step {step}, during a preemption")


def _announce(root: Path, call: tr.CallWrapper) -> None:
    """What anyone who can reach this machine's ports can find out: the round store's."""
    store: Any = call.store
    tmp = root / "round-store.json.tmp"
    tmp.write_text(json.dumps({"host": store.host, "port": store.port}))
    tmp.rename(root / "round-store.json")


def progress(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"progress-{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
