"""Rank function for the rejoin tests (module level, so spawned ranks can import it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from tests.restart._jobs import sgd_steps

TIMEOUTS: dict[str, Any] = {
    "store_timeout": 30,
    "barrier_timeout": 60,
    "completion_timeout": 60,
    "soft_timeout": 5.0,
    "hard_timeout": 10.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 30.0,
}


def rejoin_job(
    steps: int,
    victim: int,
    fault_step: int,
    hold_round: int | None,
    out_dir: str,
    overrides: dict[str, Any] | None = None,
    victim_sidecar: bool = True,
) -> dict[str, Any]:
    """One all_reduce per step (in-memory checkpoints of the last steps, as in fault_job).

    ``victim``'s first process SIGKILLs itself at ``fault_step`` of round 0 (after writing
    ``fault-<victim>``); ``victim_sidecar=False`` runs that process without a sidecar (so no
    death notice is written: the test writes it). In round ``hold_round`` the active ranks
    wait at step ``fault_step + 1`` until that round is aborted (keeps the job running while
    the test acts). Records each round's (round, rank, world) and when it was entered."""
    from trainguard import events

    events.configure(out_dir)
    incarnation = int(os.environ.get("TRAINGUARD_INCARNATION", "0"))
    history: dict[int, torch.Tensor] = {}
    rounds: list[dict[str, Any]] = []
    config = {**TIMEOUTS, **(overrides or {})}
    first_victim = int(os.environ["RANK"]) == victim and incarnation == 0
    if first_victim and not victim_sidecar:
        config["sidecar"] = False

    @tr.Wrapper(**config)
    def train(call: tr.CallWrapper) -> list[float]:
        rounds.append(
            {
                "round": call.round,
                "rank": call.rank,
                "world": call.world_size,
                "entered": time.time(),
            }
        )
        dist.init_process_group("gloo")

        def before(step: int) -> None:
            if first_victim and step == fault_step and call.round == 0:
                Path(out_dir, f"fault-{victim}").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if call.round == hold_round and step == fault_step + 1:
                while True:  # until the round is aborted (the interrupt ends the wait)
                    call.ping()
                    time.sleep(0.02)

        return sgd_steps(call, history, steps, before_step=before)

    result = train()
    return {"weights": result, "rounds": rounds, "incarnation": incarnation}
