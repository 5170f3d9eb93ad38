"""The processes of bench/gpu_check.py: each check runs here, in a process of its own.

``python bench/_gpu_jobs.py CHECK OUT.json`` runs one single-process check (``staging``,
``dcp``) and writes what it measured to ``OUT.json``; ``python bench/_gpu_jobs.py rank MODE
OUTDIR`` is one rank of a multi-process NCCL check (``demo``, ``exception``, ``hang``,
``kill``, ``live exception``, ``live kill``, ``live corrupt``; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment),
which writes ``OUTDIR/rank<N>.json``. Untested on GPUs until a run on a GPU machine exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

STEPS = 8  # steps of the NCCL jobs
FAULT_STEP = 3  # the step of round 0 at which rank 1 faults
KILLS = ("kill", "live kill", "live corrupt")  # the checks whose rank 1 is SIGKILLed
MIB = 1 << 20


def _state(mib: int) -> dict[str, Any]:
    import torch

    n = mib * MIB // 4 // 8
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"t{i}": torch.randn(n, device="cuda", generator=g) for i in range(8)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _single_group() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=120))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def staging(mib: int = 512) -> dict[str, Any]:
    """The save stall of the async and the local checkpointer for ``mib`` MiB of CUDA tensors
    (pinned staging buffers, the copy stream) against a plain ``.cpu()`` copy; both loads
    compared with the saved tensors."""
    import torch

    from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager, load

    _single_group()
    state = _state(mib)
    torch.cuda.synchronize()
    start = time.perf_counter()
    plain = {k: v.cpu() for k, v in state.items()}
    plain_s = time.perf_counter() - start
    out: dict[str, Any] = {"mib": mib, "plain_cpu_copy_s": plain_s}
    with tempfile.TemporaryDirectory() as tmp:
        with AsyncCheckpointer() as ckpt:
            for i in range(3):  # the first save allocates the pinned buffers
                start = time.perf_counter()
                handle = ckpt.save(state, f"{tmp}/async{i}")
                stall = time.perf_counter() - start
                assert handle is not None
                ckpt.wait()  # durable and committed
                out[f"async_stall_s_{i}"] = stall
        out["async_equal"] = _same(plain, load(f"{tmp}/async2"))
        with LocalCheckpointManager(f"{tmp}/local", keep=2) as mgr:
            for i in range(3):
                start = time.perf_counter()
                mgr.save(state, i)
                out[f"local_stall_s_{i}"] = time.perf_counter() - start
                mgr.wait()
            out["local_equal"] = _same(plain, mgr.load(2))
    out["ok"] = bool(out["async_equal"] and out["local_equal"])
    return out


def dcp(mib: int = 64) -> dict[str, Any]:
    """DCP save and load of CUDA tensors through trainguard's StorageWriter/StorageReader."""
    import torch
    import torch.distributed.checkpoint as tdcp

    from trainguard.checkpoint.dcp import StorageReader, StorageWriter

    _single_group()
    state = _state(mib)
    out: dict[str, Any] = {"mib": mib}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with StorageWriter(f"{tmp}/ckpt") as writer:
            tdcp.save(state, storage_writer=writer)
        out["save_s"] = time.perf_counter() - start
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        start = time.perf_counter()
        tdcp.load(back, storage_reader=StorageReader(f"{tmp}/ckpt"))
        out["load_s"] = time.perf_counter() - start
        out["on_cuda"] = all(v.is_cuda for v in back.values())
        out["ok"] = bool(out["on_cuda"] and _same(state, back))
    return out


def rank(mode: str, outdir: str) -> None:
    """One rank of an NCCL job: ``demo`` (all_reduce, no wrapper) or the wrapper with a fault
    of rank 1 in round 0: ``exception``, ``hang`` (a collective the others never enter, so the
    NCCL kernels of both sides wait until the communicator is aborted) or ``kill`` (SIGKILL;
    the spare takes its place)."""
    import torch
    import torch.distributed as dist

    me = int(os.environ["RANK"])
    gpus = torch.cuda.device_count()
    result: dict[str, Any] = {"rank": me}
    if mode.startswith("live"):
        result.update(_live(mode, gpus))
    elif mode == "demo":
        torch.cuda.set_device(me % gpus)
        dist.init_process_group("nccl", timeout=timedelta(seconds=60))
        t = torch.full((1024,), float(me + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        world = dist.get_world_size()
        result["ok"] = bool(torch.all(t == world * (world + 1) / 2).item())
        dist.destroy_process_group()
    else:
        result.update(_wrapped(mode, gpus))
    Path(outdir, f"rank{me}.json").write_text(json.dumps(result))


def _wrapped(mode: str, gpus: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr

    active = int(os.environ["WORLD_SIZE"]) - 1  # the last process is a spare
    rounds: list[int] = []

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(active),
        retry=tr.RetryController(max_rounds=3, min_active_world_size=active),
        soft_timeout=5,
        hard_timeout=20,
        barrier_timeout=120,
        heartbeat_interval=0.5,
        heartbeat_timeout=5,
    )
    def train(call: tr.CallWrapper) -> float:
        rounds.append(call.round)
        torch.cuda.set_device(call.rank % gpus)
        dist.init_process_group("nccl", timeout=timedelta(seconds=60))
        total = torch.zeros((), device="cuda")
        for step in range(STEPS):
            if call.round == 0 and call.initial_rank == 1 and step == FAULT_STEP:
                if mode == "exception":
                    raise RuntimeError("injected fault")
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "hang":
                    stray = torch.ones(1 << 20, device="cuda")
                    dist.broadcast(stray, src=call.rank)  # nobody else enters it
                    torch.cuda.synchronize()
            t = torch.full((1024,), float(call.rank + 1), device="cuda")
            dist.all_reduce(t)
            total += t[0]
            call.ping()
        torch.cuda.synchronize()
        value = float(total.item())
        dist.destroy_process_group()
        return value

    start = time.monotonic()
    value = train()
    world = active
    expected = STEPS * world * (world + 1) / 2
    return {
        "rounds": rounds,
        "value": value,
        "seconds": time.monotonic() - start,
        # a spare that was never needed returns None; the others restarted once, same sum
        "ok": value is None or (value == expected and max(rounds) >= 1),
    }


def _live(mode: str, gpus: int) -> dict[str, Any]:
    """Live state over NCCL, CUDA tensors: rank 1 raises in round 0 (``live exception``: every
    rank keeps its state, nothing moves), is SIGKILLed (``live kill``: the spare receives the
    state over NCCL from a survivor, checksummed on the device), or is SIGKILLed and every
    donor of round 1 flips a bit of what it sends (``live corrupt``: the spare refuses each,
    the round falls back: every rank starts again from the initial state here). Every rank must
    end with the fault-free parameters, bit for bit."""
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr
    from trainguard.live import LiveState

    active = int(os.environ["WORLD_SIZE"]) - 1
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % gpus)
    net, opt = _live_model()
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    live = LiveState(model=net, optimizer=opt)
    seen: list[dict[str, Any]] = []

    def flip(name: str, data: Any) -> Any:
        out = data.clone()
        out[0] ^= 1
        return out

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(active),
        retry=tr.RetryController(max_rounds=4, min_active_world_size=active),
        soft_timeout=10,
        hard_timeout=30,
        barrier_timeout=120,
        heartbeat_interval=0.5,
        heartbeat_timeout=10,
    )
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("nccl", timeout=timedelta(seconds=60))
        if mode == "live corrupt" and call.round == 1:
            live._tamper = flip  # every donor's bytes are flipped: each is refused in turn
        got = live.recover()
        live._tamper = None
        seen.append({"round": call.round, "live": got.live, "from": got.received_from})
        first = got.step
        if first is None:  # the fallback of this check: the initial state
            net.load_state_dict(initial)
            opt.state.clear()
            first = 0
            live.restored(0)
        for step in range(first, STEPS):
            if call.round == 0 and call.initial_rank == 1 and step == FAULT_STEP:
                if mode in KILLS:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected fault")
            _live_step(net, opt, step, reduce=True)
            with live.update(step, call):
                opt.step()
            call.ping()
        dist.destroy_process_group()
        return _live_digest(net)

    start = time.monotonic()
    digest = train()
    seconds = time.monotonic() - start
    net, opt = _live_model()  # the fault-free run, alone (every rank's gradient is the same)
    for step in range(STEPS):
        _live_step(net, opt, step, reduce=False)
        opt.step()
    reference = _live_digest(net)
    recovered = [s for s in seen if s["round"] >= 1]
    want_live = mode != "live corrupt"
    ok = digest is None or (
        digest == reference and bool(recovered) and bool(recovered[0]["live"]) == want_live
    )
    return {"digest": digest, "reference": reference, "rounds": seen, "seconds": seconds, "ok": ok}


def _live_model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    net = net.cuda()
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _live_step(net: Any, opt: Any, step: int, *, reduce: bool) -> None:
    """One step's gradient (a function of the step only); ``reduce``: all-reduce MAX of the
    identical gradients of every rank (exact, whatever the world size)."""
    import torch
    import torch.distributed as dist

    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(64, 256, device="cuda", generator=g)
    opt.zero_grad()
    net(x).square().mean().backward()
    for p in net.parameters():
        if reduce and p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)


def _live_digest(net: Any) -> str:
    import torch

    torch.cuda.synchronize()
    h = hashlib.sha256()
    for _, t in sorted(net.state_dict().items()):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if argv[0] == "rank":
        rank(argv[1], argv[2])
        return 0
    checks = {"staging": staging, "dcp": dcp}
    result = checks[argv[0]]()
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
