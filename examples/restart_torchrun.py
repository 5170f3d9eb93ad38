"""In-process restart under torchrun.

Run: ``torchrun --nproc-per-node 2 examples/restart_torchrun.py``.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_USE_AGENT_STORE=True; trainguard then uses torchrun's agent store for its
coordination and keeps its own per-round stores in a small process next to rank 0.

What torchrun does when a worker *exits*: its agent stops every other worker of the job (and
restarts them all if ``--max-restarts`` allows). In-process restart therefore only helps with
faults that do not end a process: an exception (here), and, with the next release, hangs.
A rank that leaves the job (its health check failed) ends its process, so under torchrun the
whole job is stopped then; use plain processes or Slurm srun to continue without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import trainguard.restart as tr

state = {"step": 0}


@tr.Wrapper(max_rounds=3)
def train(call: tr.CallWrapper) -> int:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    while state["step"] < 10:
        if call.round == 0 and call.rank == 0 and state["step"] == 4:
            raise ValueError("simulated fault")
        dist.all_reduce(t)
        with call.atomic():
            state["step"] += 1
    dist.destroy_process_group()
    print(f"rank {call.rank}: done in round {call.round}")
    return state["step"]


if __name__ == "__main__":
    train()
