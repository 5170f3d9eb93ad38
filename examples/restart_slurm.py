"""In-process restart under Slurm.

Run: ``srun --ntasks 4 python examples/restart_slurm.py`` (one task per rank).

trainguard maps SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID to the rank, world size and
local rank, takes the first host of SLURM_JOB_NODELIST as MASTER_ADDR and derives
MASTER_PORT from SLURM_JOB_ID (set MASTER_ADDR/MASTER_PORT yourself to override). Rank 0
raises once at step 3 and every rank restarts in-process. One task is kept as a spare; it takes
over when a rank's health check fails: set ``TRAINGUARD_EXAMPLE_SICK_RANK=N`` to make the
health check of initial rank N fail after that fault, so that rank leaves and the spare moves in.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import trainguard.restart as tr

steps_done = {"n": 0}


def health_check(state: tr.RoundState) -> None:
    # A real check would test the GPU, the network, the disk...
    if os.environ.get("TRAINGUARD_EXAMPLE_SICK_RANK") == str(state.initial_rank) and state.faults:
        raise RuntimeError(f"rank {state.initial_rank} is unhealthy")


@tr.Wrapper(
    rank_filter=tr.MaxActiveWorldSize(max(1, int(os.environ.get("SLURM_NTASKS", "2")) - 1)),
    health_check=health_check,
    max_rounds=5,
)
def train(call: tr.CallWrapper) -> int:
    dist.init_process_group("gloo")
    # "Load the checkpoint": a spare that just moved in has none, so take the newest.
    newest = torch.tensor([steps_done["n"]])
    dist.all_reduce(newest, op=dist.ReduceOp.MAX)
    steps_done["n"] = int(newest.item())
    t = torch.ones(1)
    while steps_done["n"] < 10:
        if call.round == 0 and call.rank == 0 and steps_done["n"] == 3:
            raise RuntimeError("simulated fault on rank 0")
        dist.all_reduce(t)
        steps_done["n"] += 1
    dist.destroy_process_group()
    print(f"initial rank {call.initial_rank} is rank {call.rank}/{call.world_size}")
    return steps_done["n"]


if __name__ == "__main__":
    try:
        result = train()
    except RuntimeError as exc:  # this rank left the job: its health check failed
        print(f"rank {os.environ.get('SLURM_PROCID')} left the job: {exc}")
    else:
        print("spare, never activated" if result is None else f"done: {result} steps")
