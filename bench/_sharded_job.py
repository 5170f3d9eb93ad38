"""Rank function of the sharded rows of ``bench/zero_loss.py``: FSDP2 or HSDP on CPU/gloo.

Every round initializes gloo, builds a CPU mesh (``(4,)``: FSDP2 1-D; ``(2, 2)``: HSDP), a
two-layer model sized so that each rank holds ``mib`` MiB of state (its parameter shards and
their AdamW ``exp_avg``/``exp_avg_sq``), shards it with ``fully_shard`` and builds its AdamW (two
parameter groups, so that a torn ``optimizer.step()`` updates one). Every ``ckpt_every`` steps
the state is saved with ``torch.distributed.checkpoint`` (``get_state_dict``/``dcp.save``, one
directory per step): today's checkpoint path. With ``live`` the rebuilt objects go to
``live.recover(model=..., optimizer=...)``; a fallback (or, without ``live``, every round after
the first) loads the newest checkpoint (``dcp.load``/``set_state_dict``).

Faults ``(kind, rank, step)`` strike once each: ``exception`` inside backward, ``hang`` (a
GIL-releasing sleep before forward, once every rank finished the last update: the others
wait in forward's all-gather; the soft timeout's restart ends it), ``torn`` (one
parameter group updated, then a failure, once the others finished the step) and ``kill``
(SIGKILL after backward; a spare takes the rank). The victim writes the fault's wall time to
``t-<i>``; every rank records, per round, when its first step of the round finished, the
newest step any rank had finished (an all-reduce) and the step it resumed from, as a line of
``records.jsonl`` (written at once: a rank killed later keeps its records). At the end of the round
after the kill, donor and receiver time a plain ``dist.send`` of the same bytes over the
same group (median of 3). With peer snapshots (``snapshot_every``) the live state copies
every rank's shards to host memory and to a buddy (no replica exists under FSDP2 1-D); each
rank also records how long its fault-free steps of the first round took (``step_s``, steps
1 to the first fault, without the checkpoint saves) for the snapshots' per-step cost.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.live._jobs import TIMEOUTS, InjectedFault, _claim, _partial_step
from torch import nn

BATCH = 8


def width(mib: int, shards: int) -> int:
    """The layers' width for ``mib`` MiB of state per rank (2 square layers, fp32, 3 copies)."""
    return max(8, int(math.sqrt(mib * 2**20 * shards / 24)) // 8 * 8)


def build(mesh: Any, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)
    net = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    groups = [{"params": list(net[0].parameters())}, {"params": list(net[2].parameters())}]
    return net, torch.optim.AdamW(groups, lr=1e-3)


def digest(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    """Every local shard of the parameters and of the optimizer state, in order."""
    from tests.live._sharded_jobs import digest as shards_digest

    return shards_digest(net, opt)


def _save(net: nn.Module, opt: torch.optim.Optimizer, root: Path, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(net, opt)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(root / f"step-{step}"))
    if dist.get_rank() == 0:
        (root / "latest.tmp").write_text(str(step))
        os.replace(root / "latest.tmp", root / "latest")
    dist.barrier()


def _load(net: nn.Module, opt: torch.optim.Optimizer, root: Path) -> int:
    """Load the newest checkpoint into ``net``/``opt``; its step (0: none yet, a fresh build)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    latest = root / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    model, optim = get_state_dict(net, opt)
    state = {"model": model, "optim": optim}
    dcp.load(state, checkpoint_id=str(root / f"step-{step}"))
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


def _fault(kind: str, i: int, out: Path) -> None:
    (out / f"t-{i}").write_text(repr(time.time()))
    if kind == "hang":
        time.sleep(24 * 3600)  # releases the GIL; the restart interrupt ends it
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


def _step(
    net: nn.Module,
    opt: Any,
    live: Any,
    step: int,
    call: Any,
    fault: tuple[str, int],
    out: Path,
    done: list[int],
) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    dim = net[0].in_features
    x = torch.randn(BATCH, dim, generator=gen)
    rows = BATCH // call.world_size
    x = x[call.rank * rows : (call.rank + 1) * rows]
    kind, i = fault
    if kind in ("hang", "others-hang"):
        dist.barrier()  # every rank finished the last update; the others wait in forward
    if kind == "hang":
        _fault(kind, i, out)
    hidden = net[1](net[0](x))
    if kind == "exception":

        def boom(grad: torch.Tensor) -> torch.Tensor:
            out.joinpath(f"t-{i}").write_text(repr(time.time()))
            raise InjectedFault("injected: an exception inside backward")

        hidden.register_hook(boom)
    net[2](hidden).square().mean().backward()
    if kind in ("kill", "others-kill"):
        dist.barrier()  # every rank is through backward's collectives when the victim dies
    if kind == "kill":
        _fault(kind, i, out)
    if live is None:
        if kind == "torn":
            out.joinpath(f"t-{i}").write_text(repr(time.time()))
            _partial_step(opt, True)
        opt.step()
    else:
        with live.update(step, call):
            if kind == "torn":
                out.joinpath(f"t-{i}").write_text(repr(time.time()))
                _partial_step(opt, True)
            opt.step()
    done[0] = step + 1  # before the barrier: a restart may interrupt this rank past it
    if kind in ("torn", "others-torn"):
        dist.barrier()  # the torn rank fails once every other rank finished this update
    opt.zero_grad()


def _outcome(got: Any) -> dict[str, Any]:
    """What a round's record keeps of a Recovery."""
    return {
        "live": got.live,
        "fallback": got.fallback,
        "nbytes": got.nbytes,
        "received_from": got.received_from,
        "receivers": list(got.receivers),
        "transfer_s": got.transfer_seconds,
        "snapshot": got.snapshot,
    }


def _append(out: Path, record: dict[str, Any]) -> None:
    """One JSON line in ``out/records.jsonl`` (kept when this process is killed later)."""
    with open(out / "records.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _send_baseline(got: Any, rank: int, world: int, round_: int, out: Path) -> None:
    """Donor and receiver of ``got`` (a Recovery) time a plain send of the received bytes."""
    mine = torch.tensor([got.received_from if got.received_from is not None else -1])
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, mine)
    receiver = got.receivers[0]
    donor = int(gathered[receiver].item())
    nbytes = torch.tensor([got.nbytes])
    dist.broadcast(nbytes, receiver)
    took = _plain_send(donor, receiver, int(nbytes.item()), rank)
    if took:
        _append(out, {"round": round_, "plain_send_s": statistics.median(took)})


def _plain_send(donor: int, receiver: int, nbytes: int, rank: int) -> list[float]:
    """A plain ``dist.send`` of ``nbytes`` from ``donor`` to ``receiver`` on the default group."""
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    took = []
    for _ in range(3):
        dist.barrier()
        start = time.monotonic()
        if rank == donor:
            dist.send(buf, receiver)
        elif rank == receiver:
            dist.recv(buf, donor)
            took.append(time.monotonic() - start)
    dist.barrier()
    return took


def job(
    steps: int,
    active: int,
    mesh_shape: tuple[int, ...],
    faults: list[tuple[str, int, int]],
    out_dir: str,
    mib: int,
    live_on: bool,
    ckpt_every: int,
    soft_timeout: float,
    snapshot_every: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps on ``active`` ranks (the others are spares), as the module
    docstring says; ``snapshot_every``: the live state's peer snapshots. Returns the digest
    of this rank's shards and its final rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import trainguard.restart as tr
    from trainguard.live import LiveState

    out, root = Path(out_dir), Path(out_dir, "ckpt")
    root.mkdir(exist_ok=True)
    live = LiveState(model=None, optimizer=None, snapshot_every=snapshot_every) if live_on else None
    names = ("replicate", "shard")[-len(mesh_shape) :]
    dim = width(mib, mesh_shape[-1])
    dist_rank = [-1]
    done = [0]  # the steps this process finished (kept across rounds: same process)
    timeouts = dict(TIMEOUTS, soft_timeout=soft_timeout)

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(), rank_filter=tr.MaxActiveWorldSize(active), **timeouts
    )
    def train(call: tr.CallWrapper) -> str:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        net, opt = build(mesh, dim)
        start = time.monotonic()
        rec: dict[str, Any] = {"round": call.round, "rank": call.rank, "live": False}
        got = live.recover(model=net, optimizer=opt) if live is not None else None
        if got is not None:
            rec.update(_outcome(got))
        if got is not None and got.step is not None:
            first = got.step
        else:
            first = _load(net, opt, root) if call.round > 0 else 0
            if live is not None:
                live.restored(first)
        rec["restore_s"] = time.monotonic() - start
        newest = torch.tensor([done[0]])
        dist.all_reduce(newest, op=dist.ReduceOp.MAX)
        if got is not None:  # what the live records say (the same on every rank)
            newest = torch.tensor([max(got.newest, int(newest.item()))])
        rec.update(first=first, newest=int(newest.item()), recomputed=int(newest.item()) - first)
        pending = [i for i in range(len(faults)) if not (out / f"fault-{i}").exists()]
        times: list[float] = []  # the fault-free steps before the first fault, round 0
        for step in range(first, steps):
            began = time.monotonic()
            fault = ("", -1)
            for i in pending:
                kind, victim, at = faults[i]
                if step != at:
                    continue
                if call.rank == victim and _claim(out / f"fault-{i}", call.round):
                    fault = (kind, i)
                elif kind != "exception":
                    fault = (f"others-{kind}", i)
            _step(net, opt, live, step, call, fault, out, done)
            if step == first:
                rec["first_step_done"] = time.time()
                _append(out, rec)
            if call.round == 0 and 0 < step < faults[0][2]:
                times.append(time.monotonic() - began)  # without the checkpoint saves
                if step + 1 == faults[0][2]:
                    snaps = live._snapshots() if live is not None else None
                    stats = dict(snaps.stats) if snaps is not None else {}
                    _append(out, {"round": 0, "rank": call.rank, "step_s": times, **stats})
            if (step + 1) % ckpt_every == 0:
                _save(net, opt, root, step + 1)
            call.ping()
        if got is not None and got.receivers:  # the last round's transfer against a plain send
            _send_baseline(got, call.rank, call.world_size, call.round, out)
        result = digest(net, opt)
        if live is not None:
            live.flush()
        dist_rank[0] = call.rank
        dist.destroy_process_group()
        return result

    result = train()
    return {"digest": result, "rank": dist_rank[0]}
