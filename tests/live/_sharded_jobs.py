"""Rank functions for the sharded live-state tests: FSDP2 (1-D mesh) and HSDP (2-D mesh) on CPU.

Every round initializes gloo, builds a CPU device mesh over the round's world, builds the model
from the same seed and shards it with ``fully_shard`` (uneven: 16 rows over the shard ranks),
builds its AdamW (two parameter groups: a torn ``optimizer.step()`` updates one), and hands both
to ``live.recover(model=..., optimizer=...)``. A fallback starts again from step 0 (no
checkpoint here: a fresh build's state is loaded over whatever a refused transfer left). Each rank's batch is its rows of one global batch,
a function of the step. The result is a digest of every local shard of the parameters and of
the optimizer state, compared with a fault-free run's on the same rank.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.live._jobs import TIMEOUTS, InjectedFault, _claim, _partial_step

BATCH = 16


def build(mesh: Any, tp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model on ``mesh``: FSDP2 (HSDP on a 2-D mesh), or with ``tp`` tensor parallel
    (layer 0 column-wise, layer 2 row-wise: Shard(0), Shard(1) and a replicated bias)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 4))
    if tp:
        parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        for layer in (net[0], net[2], net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    groups = [{"params": list(net[0].parameters())}, {"params": list(net[2:].parameters())}]
    return net, torch.optim.AdamW(groups, lr=1e-2)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 8, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)
    rows = BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def digest(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    """Every local shard of the parameters and of the optimizer state, in order."""
    from trainguard.live import _sharded

    h = hashlib.sha256()
    local, _ = _sharded.local_form({"model": net.state_dict(), "optim": opt.state_dict()})
    stack: list[tuple[str, Any]] = [("", local)]
    while stack:
        name, node = stack.pop()
        if isinstance(node, dict):
            stack += [
                (f"{name}.{k}", v) for k, v in sorted(node.items(), key=lambda kv: str(kv[0]))
            ]
        elif isinstance(node, list):
            stack += [(f"{name}.{i}", v) for i, v in enumerate(node)]
        elif isinstance(node, torch.Tensor):
            h.update(name.encode())
            h.update(node.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={node!r}".encode())
    return h.hexdigest()


def _bytes(state: Any) -> int:
    """The bytes of every tensor of ``state`` (of a DTensor: its global tensor's)."""
    total, stack = 0, [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack += list(node.values())
        elif isinstance(node, list | tuple):
            stack += list(node)
        elif isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
    return total


def _flip(name: str, data: torch.Tensor) -> torch.Tensor:
    out = data.clone()
    out[0] ^= 1
    return out


def _step(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    live: Any,
    step: int,
    call: Any,
    fault: str,
    tp: bool = False,
) -> None:
    x, y = _batch(step, 0, 1) if tp else _batch(step, call.rank, call.world_size)
    if fault in ("forward", "others-forward"):
        dist.barrier()  # every rank finished the last update when the victim fails
    hidden = net[1](net[0](x))
    if fault == "forward":  # the others wait in the next layer's collective
        raise InjectedFault("injected: an exception in forward")
    if fault == "backward":

        def boom(grad: torch.Tensor) -> torch.Tensor:
            raise InjectedFault("injected: an exception inside backward")

        hidden.register_hook(boom)
    loss = nn.functional.cross_entropy(net[4](net[3](net[2](hidden))), y)
    loss.backward()
    if fault in ("kill", "others-kill"):
        live.flush()  # the last snapshot reached the buddy (a no-op without snapshots)
        dist.barrier()  # every rank is through backward's collectives when the victim dies
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    sync = fault.startswith("torn") or fault == "others-torn"
    with live.update(step, call):
        if fault == "torn":
            _partial_step(opt, True)
        opt.step()
    if sync:
        dist.barrier()  # the torn rank fails once every other rank finished this update
    opt.zero_grad()


def sharded_job(
    steps: int,
    active: int,
    mesh_shape: tuple[int, ...],
    faults: list[tuple[str, int, int]],
    out_dir: str,
    tamper_rank: int | None = None,
    tp: bool = False,
    snapshot_every: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps on ``active`` ranks (the others are spares) on a mesh of
    ``mesh_shape`` (``(n,)``: FSDP2, or tensor parallel with ``tp``; ``(r, s)``: HSDP, ``r``
    replicas of ``s`` shards; ``()``: FSDP2 over the round's world). Each
    fault ``(kind, rank, step)`` strikes once (file ``fault-<i>`` holds its round). In the
    round after the first fault, rank ``tamper_rank`` flips a bit of everything it sends as
    a donor. ``snapshot_every``: peer snapshots (``LiveState(snapshot_every=...)``).
    Returns the digest, the final step and every round's recovery."""
    from torch.distributed.device_mesh import init_device_mesh

    import trainguard.restart as tr
    from trainguard.live import LiveState

    live = LiveState(model=None, optimizer=None, snapshot_every=snapshot_every)
    recoveries: list[dict[str, Any]] = []
    names = ("replicate", "shard")[-len(mesh_shape or (1,)) :]

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(), rank_filter=tr.MaxActiveWorldSize(active), **TIMEOUTS
    )
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("gloo")
        shape = mesh_shape or (call.world_size,)  # (): a 1-D mesh over the round's world
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        net, opt = build(mesh, tp)
        marker = Path(out_dir, "fault-0")
        if marker.exists() and call.round == int(marker.read_text()) + 1:
            live._tamper = _flip if call.rank == tamper_rank else None
        got = live.recover(model=net, optimizer=opt)
        live._tamper = None
        first = got.step
        if first is None:  # no checkpoint here: load a fresh build's state (step 0) over it
            fresh, fresh_opt = build(mesh, tp)
            net.load_state_dict(fresh.state_dict())
            opt.load_state_dict(fresh_opt.state_dict())
            first = 0
            live.restored(0)
        recoveries.append(
            {
                "round": call.round,
                "rank": call.rank,
                "live": got.live,
                "step": got.step,
                "fallback": got.fallback,
                "received_from": got.received_from,
                "receivers": list(got.receivers),
                "recomputed": got.recomputed,
                "snapshot": got.snapshot,
                "nbytes": got.nbytes,
                "local_bytes": _bytes(live._outgoing()),  # this rank's shards and the rest
                "global_bytes": _bytes(live.state_dict()),
            }
        )
        # the faults still to strike, as every rank sees them when the round starts
        pending = [i for i in range(len(faults)) if not Path(out_dir, f"fault-{i}").exists()]
        for step in range(first, steps):
            fault = ""
            for i in pending:
                kind, victim, at = faults[i]
                if step != at:
                    continue
                if call.rank == victim and _claim(Path(out_dir, f"fault-{i}"), call.round):
                    fault = kind
                elif kind in ("torn", "kill", "forward"):
                    fault = f"others-{kind}"
            _step(net, opt, live, step, call, fault, tp)
            call.ping()
        out = digest(net, opt)
        live.flush()
        dist.destroy_process_group()
        return out

    result = train()
    return {
        "digest": result,
        "recoveries": recoveries,
        "step": live.step,
        "rank": recoveries[-1]["rank"],
    }


def partial_job() -> str:
    """What a LiveState says of a DTensor with a Partial placement (one rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from trainguard.errors import ConfigError
    from trainguard.live import _sharded

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (1,))
        holder = nn.Module()
        holder.register_buffer("sum", DTensor.from_local(torch.ones(2), mesh, [Partial()]))
        try:
            _sharded.signature({"model": holder})
        except ConfigError as exc:
            return str(exc)
        return "accepted"
    finally:
        dist.destroy_process_group()
