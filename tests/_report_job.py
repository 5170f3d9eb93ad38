"""The rank function of the report tests' recorded run (module level, so spawned ranks import it).

A tiny data-parallel regression that follows the report's event contract: ``train_step`` at the
end of every step, a ``ckpt_stall`` span around an in-memory checkpoint every ``every`` steps,
and a ``demo_fault`` right before rank ``fault_rank`` raises at ``fault_step`` in round 0.
After the restart every rank resumes from the newest checkpoint that all ranks hold.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import trainguard.restart as tr
from trainguard import events

DIM = 4


def recorded_run(
    events_dir: str, steps: int, every: int, fault_rank: int, fault_step: int, step_s: float
) -> int:
    events.configure(events_dir)
    saved: dict[int, torch.Tensor] = {}  # step -> weights after that step

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        newest = torch.tensor([max(saved) if saved else -1])
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        start = int(newest.item())
        w = saved[start].clone() if start >= 0 else torch.zeros(DIM, dtype=torch.float64)
        for step in range(start + 1, steps):
            if call.round == 0 and call.rank == fault_rank and step == fault_step:
                events.emit("demo_fault", fault="exception", step=step, target=call.rank)
                raise ValueError(f"injected at step {step}")
            t0 = time.monotonic()
            g = torch.Generator().manual_seed(step * 100 + call.rank)
            x = torch.randn(16, DIM, generator=g, dtype=torch.float64)
            loss = ((x @ w - x.sum(1)) ** 2).mean()
            grad = 2 * x.T @ (x @ w - x.sum(1)) / len(x)
            dist.all_reduce(grad)
            w = w - 0.05 * grad / call.world_size
            time.sleep(step_s)  # a step long enough to see on the timeline
            events.emit("train_step", step=step, duration=time.monotonic() - t0, loss=loss.item())
            if step % every == every - 1:
                with events.span("ckpt_stall", what="local", step=step), call.atomic():
                    saved[step] = w.clone()
                    time.sleep(step_s / 4)
        dist.destroy_process_group()
        return steps

    return int(train())
