"""In-process restart under torchrun.

Run: ``torchrun --nproc-per-node 2 examples/restart_torchrun.py``.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_USE_AGENT_STORE=True; trainguard then uses torchrun's agent store for its
coordination and keeps its own per-round stores in a small process next to rank 0.

Under torchrun, in-process restart covers the faults that leave every worker process alive:
an exception (here: rank 0 raises at step 4, both ranks restart in-process and finish) and a
hang that the watchdog interrupts (``soft_timeout``). When a worker process *exits* (it dies,
its sidecar kills it for a hang that holds the GIL, or it leaves the job after a failed health
check), torchrun's agent stops every other worker and, if ``--max-restarts`` allows, starts
them all again; the Wrapper works in that restarted attempt too (each attempt has keys of its
own). To keep the survivors' processes when a worker dies, run the same script under
``trainguard launch --nproc-per-node 2``, which respawns that worker alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import trainguard.restart as tr

state = {"step": 0}


@tr.Wrapper(max_rounds=3)
def train(call: tr.CallWrapper) -> int:
    dist.init_process_group("gloo")
    # Agree on the step first. A collective that a fault aborts can have completed on some
    # ranks and not on others, so the ranks' counters may differ by one after a fault; a rank
    # a step behind would then wait in a collective that its peers never start. (Real
    # training restores one consistent state here: trainguard.live or a checkpoint.)
    step = torch.tensor([state["step"]])
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    state["step"] = int(step.item())
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
