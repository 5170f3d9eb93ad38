"""Rank functions for the live-state tests (module level, for the rank processes).

The job trains a small MLP under the restart wrapper with its state in a :class:`LiveState`.
Every rank computes its gradient on the same batch (a function of the step only) and the ranks
combine gradients with an all-reduce MAX: the result is exact whatever the number of ranks, so
the test process computes the fault-free parameters alone (:func:`reference`) and a job that
shrank must still match them bit for bit.
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

TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 60,
    "completion_timeout": 60,
    "soft_timeout": 10.0,  # a loaded machine stalls a rank for seconds: not a hang here
    "hard_timeout": 30.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 30.0,
}


class InjectedFault(Exception):
    """A fault the test asked for."""


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    groups = [{"params": list(net[0].parameters())}, {"params": list(net[2:].parameters())}]
    return net, torch.optim.AdamW(groups, lr=1e-2)  # two groups: a torn step updates one


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(net.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _partial_step(opt: torch.optim.Optimizer, sync: bool) -> None:
    """``opt.step()`` on the first parameter group only, then a failure: a torn update.
    ``sync``: first wait until the other ranks finished their own update of this step."""
    groups = opt.param_groups
    opt.param_groups = groups[:1]
    try:
        opt.step()
    finally:
        opt.param_groups = groups
    if sync:
        dist.barrier()
    raise InjectedFault("injected: optimizer.step() failed after updating some parameters")


def step_once(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    live: Any,
    step: int,
    world: int,
    fault: str,
    call: Any = None,
    sync: bool = False,
) -> None:
    """One step; ``fault`` is what this rank suffers in it ("" for nothing). ``sync`` (the
    step of a torn update, on every rank): the torn rank fails only once every other rank has
    finished this step's update, so that they all are donors at the newest step (else which
    of them finished it before the abort depends on the machine's load)."""
    x, y = batch(step)
    opt.zero_grad(set_to_none=False)
    hidden = net[1](net[0](x))
    if fault == "backward":

        def boom(grad: torch.Tensor) -> torch.Tensor:
            raise InjectedFault("injected: an exception inside backward")

        hidden.register_hook(boom)
    loss = nn.functional.cross_entropy(net[4](net[3](net[2](hidden))), y)
    loss.backward()
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    if fault == "behind":  # fails before its update, once the others finished theirs
        dist.barrier()
        raise InjectedFault("injected: an exception before optimizer.step()")
    with live.update(step, call):
        if fault == "torn":
            _partial_step(opt, sync)
        opt.step()
    if sync:
        dist.barrier()


def reference(steps: int) -> str:
    """The fault-free parameters' digest, computed in this process (no other rank needed)."""
    from trainguard.live import LiveState

    net, opt = make()
    live = LiveState(model=net, optimizer=opt)
    for step in range(steps):
        step_once(net, opt, live, step, 1, "")
    return digest(net)


def live_job(
    steps: int,
    active: int,
    fault: str,
    victim: int,
    at: int,
    out_dir: str,
    tamper_rank: int | None = None,
    own_groups: bool = False,
    tamper: str = "flip",
    interrupt_fallback: int | None = None,
    pack: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps on ``active`` ranks (the others wait as spares); rank ``victim``
    suffers ``fault`` at step ``at``, once (the first round that gets there: a loaded machine
    may add a round before it); the file ``fault`` records that round. In the round after
    it, rank ``tamper_rank`` as a donor flips a bit of every tensor it sends (``tamper``
    "flip") or SIGKILLs itself before it sends its third large tensor ("kill": the donor
    dies mid-transfer). ``own_groups``: every rank is a replica group of its own (sharded
    state without replicas). A fallback starts again from step 0 (these tests keep no
    checkpoint); rank ``interrupt_fallback``'s first fallback after the fault raises once it
    has loaded the model, before the optimizer and ``restored()``. ``pack``: the transfer's
    pack limit (small: every tensor travels in messages of its own, received in place).
    Returns the digest and every round's recovery."""
    import trainguard.restart as tr
    from trainguard import events
    from trainguard.live import LiveState

    events.configure(out_dir)
    net, opt = make()
    initial = {"model": net.state_dict(), "optim": opt.state_dict()}
    initial = {k: _clone(v) for k, v in initial.items()}
    live = LiveState(model=net, optimizer=opt, replica_group=_own if own_groups else None)
    recoveries: list[dict[str, Any]] = []
    marker = Path(out_dir, "fault")

    if pack is not None:
        from trainguard.live import _transfer

        _transfer.PACK = pack
    sent: list[str] = []

    def flip(name: str, data: torch.Tensor) -> torch.Tensor:
        out = data.clone()
        out[0] ^= 1
        return out

    def die(name: str, data: torch.Tensor) -> torch.Tensor:
        sent.append(name)
        if len(sent) == 3:
            time.sleep(0.5)  # the first two are on the receiver (in place) by now
            os.kill(os.getpid(), signal.SIGKILL)
        return data

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(active),
        **TIMEOUTS,
    )
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("gloo")
        after = marker.exists() and call.round == int(marker.read_text()) + 1
        if after and call.rank == tamper_rank:
            live._tamper = flip if tamper == "flip" else die
        got = live.recover()
        live._tamper = None
        first = got.step
        if first is None:  # fall back: no checkpoint in these tests, start again
            net.load_state_dict(initial["model"])
            interrupt = call.rank == interrupt_fallback and marker.exists()
            if interrupt and _claim(Path(out_dir, "interrupted"), call.round):
                raise InjectedFault("injected: the fallback's load failed half way")
            opt.load_state_dict(_clone(initial["optim"]))
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
                "attempts": got.attempts,
                "recomputed": got.recomputed,
                "newest": got.newest,
            }
        )
        for step in range(first, steps):
            hit = call.rank == victim and step == at and _claim(marker, call.round)
            sync = fault in ("torn", "behind") and step == at and call.round == 0
            sync = sync and call.world_size > 1
            step_once(net, opt, live, step, call.world_size, fault if hit else "", call, sync)
            call.ping()
        dist.destroy_process_group()
        return digest(net)

    result = train()
    return {"digest": result, "recoveries": recoveries, "step": live.step}


def _claim(marker: Path, round_: int) -> bool:
    """True once per job: creates ``marker`` holding ``round_``."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, str(round_).encode())
    os.close(fd)
    return True


def _own(rank: int, world: int) -> int:
    return rank


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def transfer_job(
    flip: bool, chunk: int | None = None, flip_chunk: int = 0, checksum: str | None = None
) -> dict[str, Any]:
    """Rank 0 sends a state with a large tensor (its own messages) and small ones (the pack) to
    rank 1, whose own large tensor of the same size takes the bytes in place; ``flip``: a bit
    of the large tensor's chunk ``flip_chunk`` flips on the way; ``chunk``: the donor's chunk
    size (the receiver follows the header); ``checksum``: the donor's (default: the wire
    device's, ``xxh3`` here; ``words`` is what a GPU computes, run here on the CPU)."""
    from trainguard.live import _transfer

    dist.init_process_group("gloo")
    try:
        gen = torch.Generator().manual_seed(5)
        big = torch.randn(1 << 19, generator=gen)  # 2 MiB
        state = {"big": big, "small": [torch.arange(10), torch.tensor(2.5)], "step": 3}
        if dist.get_rank() == 0:
            if chunk is not None:
                _transfer.CHUNK = chunk
            seen = []

            def tamper(name: str, data: torch.Tensor) -> torch.Tensor:
                seen.append(name)
                if not flip or name != "big" or seen.count("big") != flip_chunk + 1:
                    return data
                out = data.clone()
                out[100] ^= 4
                return out

            out = _transfer.prepare(state, 7, checksum=checksum)
            for work in _transfer.send(out, 1, tamper=tamper):
                work.wait()
            return {}
        mine = {"big": torch.zeros(1 << 19), "small": [torch.zeros(10), torch.tensor(0.0)]}
        into = _transfer.own_bytes(mine)
        got = _transfer.receive(0, 7, into=into)
        if got.state is None:
            return {"problem": got.problem, "nbytes": got.nbytes}
        return {
            "problem": None,
            "same": all(
                torch.equal(a, b)
                for a, b in [
                    (got.state["big"], big),
                    *zip(got.state["small"], state["small"], strict=True),
                ]
            ),
            "step": got.state["step"],
            "in_place": got.state["big"].data_ptr() == mine["big"].data_ptr(),
            "into": sorted(into),
            "nbytes": got.nbytes,
        }
    finally:
        dist.destroy_process_group()
