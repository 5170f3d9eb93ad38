"""Rank functions for the sharded-state restart tests: an FSDP2 model with Adam under the Wrapper.

Each round initializes gloo, builds a CPU device mesh over the round's world, shards a small
model with ``fully_shard`` (uneven: 7 rows over 3 or 4 ranks), opens a
:class:`LocalCheckpointManager` (``CliqueReplication(2, jump=1)``: pairs 0-1 and 2-3), loads
the newest local iteration into the round's own sharding (``mgr.load(it, into=target)``:
resharded when the world changed), trains and saves every ``EVERY`` steps. The data of a step is the same whatever the
world: a global batch split evenly over the ranks. Module level, so spawned ranks import it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr

STEPS = 10
EVERY = 3  # a local checkpoint after steps 3, 6, 9
BATCH = 12  # divisible by 3 and 4: every rank gets whole rows of the global batch
TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 90,
    "completion_timeout": 90,
    "soft_timeout": 30.0,  # a loaded 2-core machine: a save or a load may take seconds
    "hard_timeout": 60.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 30.0,
    "max_rounds": 4,  # one restart is expected
}

Full = dict[str, torch.Tensor]  # the gathered (full) tensors of a state, by dotted key


def _model(world: int) -> torch.nn.Module:
    """The same initial parameters on every rank, sharded over the round's CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 5, generator=g)
    y = torch.randn(BATCH, 3, generator=g)
    rows = BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def _state(net: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def full_tensors(node: Any, prefix: str = "") -> Full:
    """Every tensor leaf of ``node`` as a full tensor (a DTensor gathered: a collective, every
    rank calls it), by dotted key."""
    from torch.distributed.tensor import DTensor

    if isinstance(node, dict):
        return {
            k: v
            for key, val in node.items()
            for k, v in full_tensors(val, f"{prefix}{key}.").items()
        }
    if isinstance(node, (list, tuple)):
        return {
            k: v
            for i, val in enumerate(node)
            for k, v in full_tensors(val, f"{prefix}{i}.").items()
        }
    if isinstance(node, DTensor):
        return {prefix[:-1]: node.full_tensor().clone()}
    if isinstance(node, torch.Tensor):
        return {prefix[:-1]: node.detach().clone()}
    return {}


def _step(
    net: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int
) -> None:
    x, y = _batch(step, rank, world)
    loss = ((net(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def reference_run(port: int, steps: int) -> Full:
    """The fault-free run: 4 ranks on a plain process group of their own (before the Wrapper),
    no checkpoints; returns the final full parameters."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        net = _model(4)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        for step in range(steps):
            _step(net, opt, step, rank, 4)
        return full_tensors(dict(net.state_dict()))
    finally:
        dist.destroy_process_group()


class _Trainer:
    """The function run under the Wrapper, with this process's memory across rounds."""

    def __init__(self, out: str, steps: int, victim: int, kill_step: int) -> None:
        self.out = Path(out)
        self.steps = steps
        self.victim = victim
        self.kill_step = kill_step
        self.saved: dict[int, Full] = {}  # iteration -> the full state saved (model, optim)
        self.rounds: list[dict[str, Any]] = []
        self.resources: list[Any] = []  # this round's manager, closed by release()

    def __call__(self, call: tr.CallWrapper) -> Full:
        from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

        dist.init_process_group("gloo")
        record: dict[str, Any] = {"round": call.round, "rank": call.rank, "world": call.world_size}
        self.rounds.append(record)
        net = _model(call.world_size)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        root = self.out / f"node{call.initial_rank}"
        mgr = LocalCheckpointManager(
            root, replication=CliqueReplication(2, jump=1), keep=2, timeout=60
        )
        self.resources.append(mgr)
        first = self._resume(mgr, net, opt, record)
        for step in range(first, self.steps):
            if call.round == 0 and call.initial_rank == self.victim and step == self.kill_step:
                (self.out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            _step(net, opt, step, call.rank, call.world_size)
            call.ping()
            done = step + 1
            if done % EVERY == 0 and done < self.steps:
                state = _state(net, opt, done)
                mgr.save(state, done)
                mgr.wait()  # durable with its copies: the kill cannot leave it half replicated
                self.saved[done] = full_tensors({"model": state["model"], "optim": state["optim"]})
        final = full_tensors(dict(net.state_dict()))
        self.release(strict=True)
        return final

    def _resume(
        self,
        mgr: Any,
        net: torch.nn.Module,
        opt: torch.optim.Optimizer,
        record: dict[str, Any],
    ) -> int:
        """Load the newest local iteration into this round's sharding; the first step to run."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        it = mgr.find_latest()
        record["found"] = it
        if it is None:
            return 0
        target = _state(net, opt, -1)
        loaded = mgr.load(it, into=target)
        assert loaded is target, "load(into=) returns the target it filled"
        set_state_dict(net, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        record["step"] = target["step"]
        # what the model and optimizer hold now, gathered: compared with what was saved
        record["loaded"] = full_tensors(_state(net, opt, -1))
        return int(target["step"])

    def release(self, state: Any = None, *, strict: bool = False) -> None:
        """Close this round's manager and process group (also the Wrapper's finalize hook:
        after a fault the errors of closing are expected and ignored)."""
        from trainguard._teardown import close_round

        resources, self.resources = self.resources, []
        close_round(resources, strict=strict)


def sharded_job(
    out: str, steps: int, victim: int, kill_step: int, spare: bool, ref_port: int
) -> dict[str, Any]:
    """One process of the job: 4 ranks (and one spare with ``spare``); ``victim`` (initial rank)
    SIGKILLs itself at ``kill_step`` of round 0. Processes 0..3 first train fault-free on a
    plain group of their own (the reference). Returns the final full parameters (None on a
    spare that never became active), the reference, the rounds seen and the saved states."""
    torch.set_num_threads(1)
    from trainguard import events

    events.configure(out)
    process = int(os.environ["RANK"])
    reference = reference_run(ref_port, steps) if process < 4 else None
    trainer = _Trainer(out, steps, victim, kill_step)
    options: dict[str, Any] = {**TIMEOUTS, "finalize": trainer.release}
    if spare:
        options.update(rank_filter=tr.MaxActiveWorldSize(4), rank_assignment=tr.FillGaps())
    result = tr.Wrapper(**options)(trainer)()
    # numpy arrays: a tensor sent to the parent would travel as a shared-memory handle, which
    # dies with this process
    rounds = [{k: _arrays(v) if k == "loaded" else v for k, v in r.items()} for r in trainer.rounds]
    return {
        "final": _arrays(result),
        "reference": _arrays(reference),
        "rounds": rounds,
        "saved": {it: _arrays(full) for it, full in trainer.saved.items()},
    }


def _arrays(full: Full | None) -> dict[str, Any] | None:
    return None if full is None else {k: v.numpy() for k, v in full.items()}
