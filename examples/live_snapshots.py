"""Peer snapshots: FSDP2 on a 1-D mesh (no replica of any shard) survives a killed rank.

Run: ``python examples/live_snapshots.py``. The script starts its own ranks (as a launcher
would) on CPU with gloo: 2 training ranks and 1 spare. With ``LiveState(snapshot_every=1)``
every rank copies its shards (and their Adam state) into host memory after each update, in
the background, and sends the same bytes to its buddy (the other rank). At step 4 rank 1 is
killed (SIGKILL, after backward). The spare takes its place and receives rank 1's shards of
step 4 from rank 0's copy; rank 0, which finished step 4's update, goes back to its own
snapshot of step 4: one step recomputed, no checkpoint read. The run is then compared with a
fault-free one on 2 ranks: every rank's shards must be bit-identical.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
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
TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 60,
    "soft_timeout": 20.0,
    "hard_timeout": 60.0,
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 30.0,
}


def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, every round
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def shards_digest(net: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's local shards of the parameters and of the Adam state."""
    h = hashlib.sha256()
    tensors = list(net.state_dict().values())
    tensors += [v for state in opt.state_dict()["state"].values() for v in state.values()]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(active: int, kill: bool) -> tuple[int, str]:
    live = LiveState(model=None, optimizer=None, snapshot_every=1)  # once per process
    rank_now = [-1]

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(), rank_filter=tr.MaxActiveWorldSize(active), **TIMEOUTS
    )
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("gloo")
        net, opt = build(init_device_mesh("cpu", (active,)))
        got = live.recover(model=net, optimizer=opt)  # the round's objects
        if got.live:
            first = got.step
        else:
            first = 0  # the first start (a real job loads its checkpoint here)
            live.restored(first)
        if call.rank == 0:
            how = "from peer snapshots" if got.snapshot else "live" if got.live else "fresh start"
            again = f", {got.recomputed} step(s) recomputed" if got.live else ""
            print(f"  round {call.round}: step {first} ({how}){again}")
        if got.received_from is not None:
            print(
                f"  round {call.round}: rank {call.rank} received its shards from rank "
                f"{got.received_from}'s snapshot copy ({got.nbytes} bytes)"
            )
        for step in range(first, STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 16, generator=g)[call.rank * 4 : call.rank * 4 + 4]
            net(x).pow(2).mean().backward()
            if kill and call.round == 0 and step == 4:
                live.flush()  # (so that the kill lands after the last snapshot arrived)
                dist.barrier()
                if call.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            with live.update(step, call):
                opt.step()
            opt.zero_grad()
            call.ping()
        digest = shards_digest(net, opt)
        live.flush()  # the snapshot in flight, before its group goes
        rank_now[0] = call.rank
        dist.destroy_process_group()
        return digest

    result: str = train()
    return rank_now[0], result


def rank_main(rank: int, world: int, port: int, active: int, kill: bool, q: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    q.put(run(active, kill))


def job(world: int, active: int, kill: bool) -> dict[int, str]:
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, active, kill, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in range(world - (1 if kill else 0)))
    for p in procs:
        p.join()
    return got


if __name__ == "__main__":
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    print("FSDP2, 1-D mesh of 2 + 1 spare, snapshot_every=1: rank 1 killed at step 4")
    faulted = job(3, 2, True)
    print("the same steps on 2 ranks without a fault")
    clean = job(2, 2, False)
    same = faulted == clean
    print(f"every rank's shards identical to the fault-free run: {same}")
    raise SystemExit(0 if same else 1)
