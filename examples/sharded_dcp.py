"""Train an FSDP2 model, checkpoint it with torch.distributed.checkpoint through trainguard, resume.

Run (CPU, gloo): ``torchrun --standalone --nproc-per-node 2 examples/sharded_dcp.py [--root DIR]``.
A torchtitan-style loop: the model is sharded with ``fully_shard``; model and optimizer state come
from ``get_state_dict``; every few steps ``dcp.async_save`` stages the state into trainguard's
shared-memory buffer (the only stall) and trainguard's writer process writes one checksummed
safetensors file per rank; the directory is committed once every rank's file is durable. Run it
again with more ``--steps`` and it resumes from ``trainguard.checkpoint.latest(root)``, on any
number of ranks (DCP reshards).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainguard.checkpoint import latest
from trainguard.checkpoint.dcp import AsyncStager, StorageReader, StorageWriter


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str) -> int:
    """Load the newest committed checkpoint under ``root``; the step to start from."""
    path = latest(root)
    if path is None:
        return 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "train": {"step": -1}}
    dcp.load(state, storage_reader=StorageReader(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['train']['step'] + 1}", flush=True)
    return int(state["train"]["step"]) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.path.join(tempfile.gettempdir(), f"trainguard-sharded-dcp-{os.getuid()}")
    parser.add_argument("--root", default=default, help="checkpoint root (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="train until this step")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(world)
    first = resume(model, optimizer, args.root)
    ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives run beside training's
    # one writer (with its writer process) and one stager for the whole run, on every rank
    with StorageWriter(args.root) as writer, AsyncStager(writer) as stager:
        pending = None
        for step in range(first, args.steps):
            g = torch.Generator().manual_seed(step * world + rank)  # this rank's batch
            x = torch.randn(16, 32, generator=g)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % args.every == args.every - 1 or step == args.steps - 1:
                if pending is not None:
                    pending.result()  # the previous save is committed (its buffer is free)
                model_sd, optim_sd = get_state_dict(model, optimizer)
                started = time.monotonic()
                pending = dcp.async_save(
                    {"model": model_sd, "optim": optim_sd, "train": {"step": step}},
                    checkpoint_id=os.path.join(args.root, f"step{step:05d}"),
                    storage_writer=writer,
                    async_stager=stager,
                    process_group=ckpt_group,
                )
                if rank == 0:
                    stall = (time.monotonic() - started) * 1e3
                    print(f"step {step}: loss {loss.item():.4f}, async_save stalled {stall:.1f} ms")
        if pending is not None:
            pending.result()
    if rank == 0:
        print(f"latest checkpoint: {latest(args.root)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
