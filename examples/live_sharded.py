"""Zero lost steps for sharded state: an FSDP2 and an HSDP model recover a fault from peers.

Run: ``python examples/live_sharded.py``. The script starts its own ranks (as a launcher
would) on CPU with gloo, twice per model: once with a fault, once without, and checks that
both runs end with the same bits in every rank's shards of the parameters and of the optimizer
state.

- FSDP2 on a 1-D mesh of 2 ranks: rank 1 raises inside backward at step 4. Nobody's update
  was torn, so every rank keeps its own shards and the run resumes at step 4.
- HSDP on a 2 x 2 mesh (2 replicas of 2 shards): rank 1's ``optimizer.step()`` fails half
  way at step 4 (after the other ranks finished theirs). Its shards are neither step; rank 3
  holds the same shards and sends them (and their Adam state), the others keep theirs, and
  the run resumes at step 5.

The model is sharded again every round (a mesh belongs to its round's process group); the
:class:`LiveState` outlives the rounds and is given the round's objects in ``recover()``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard.restart as tr
from trainguard.live import LiveState

STEPS = 8


def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, every round
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )
    for layer in (net[0], net[2], net[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    # two parameter groups: the failing optimizer.step() below updates only the first
    groups = [{"params": list(net[0].parameters())}, {"params": list(net[2:].parameters())}]
    return net, torch.optim.AdamW(groups, lr=1e-2)


def shards_digest(net: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's local shards of the parameters and of the Adam state."""
    h = hashlib.sha256()
    tensors = list(net.state_dict().values())
    tensors += [v for state in opt.state_dict()["state"].values() for v in state.values()]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fail(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("fault in backward")


def run(mesh_shape: tuple[int, ...], fault: str) -> str:
    live = LiveState(model=None, optimizer=None)  # once per process: the names only
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    struck = False

    @tr.Wrapper(max_rounds=4, barrier_timeout=60, soft_timeout=30.0, hard_timeout=60.0)
    def train(call: tr.CallWrapper) -> str:
        nonlocal struck
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        net, opt = build(mesh)
        got = live.recover(model=net, optimizer=opt)  # the round's objects
        if got.live:
            first = got.step
        else:
            first = 0  # the first start (a real job loads its checkpoint here)
            live.restored(first)
        if call.rank == 0:
            how = "live" if got.live else f"fallback: {got.fallback}"
            print(f"  round {call.round}: step {first} ({how}), receivers {list(got.receivers)}")
        if got.received_from is not None:
            print(
                f"  round {call.round}: rank {call.rank} received its shards from rank "
                f"{got.received_from} ({got.nbytes} bytes), {got.recomputed} steps recomputed"
            )
        for step in range(first, STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 16, generator=g)[call.rank * 2 : call.rank * 2 + 2]
            hit = fault and not struck and call.rank == 1 and step == 4
            loss = net(x).pow(2).mean()
            if hit and fault == "backward":
                struck = True
                loss.register_hook(_fail)
            loss.backward()
            torn = fault == "torn" and call.round == 0 and step == 4
            with live.update(step, call):
                if hit and torn:
                    struck = True
                    groups, opt.param_groups = opt.param_groups, opt.param_groups[:1]
                    opt.step()  # the first parameter group only, then the failure
                    opt.param_groups = groups
                    dist.barrier()  # (the others finished their update: see the docstring)
                    raise RuntimeError("fault inside optimizer.step()")
                opt.step()
            if torn:
                dist.barrier()
            opt.zero_grad()
            call.ping()
        digest = shards_digest(net, opt)
        dist.destroy_process_group()
        return digest

    result: str = train()
    return result


def rank_main(rank: int, world: int, port: int, mesh: tuple[int, ...], fault: str, q: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    q.put((rank, run(mesh, fault)))


def job(mesh: tuple[int, ...], fault: str) -> dict[int, str]:
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world, q = int(torch.tensor(mesh).prod()), ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, mesh, fault, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return got


if __name__ == "__main__":
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    ok = True
    for label, mesh, fault in [
        ("FSDP2, 1-D mesh of 2", (2,), "backward"),
        ("HSDP, 2 x 2 mesh", (2, 2), "torn"),
    ]:
        print(f"{label}: a fault ({fault})")
        faulted = job(mesh, fault)
        print(f"{label}: the same steps without a fault")
        clean = job(mesh, "")
        same = faulted == clean
        ok = ok and same
        print(f"{label}: every rank's shards identical to the fault-free run: {same}")
    raise SystemExit(0 if ok else 1)
