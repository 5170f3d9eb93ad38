"""Jobs of the quarantine tests (each rank's host named by TRAINGUARD_HOST_NAME, one a rank)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.restart as tr
from trainguard.errors import RetryLimitError

_rounds: list[int] = []  # the rounds whose function ran in this rank's process


def _sum_of_ones() -> int:
    """The round's collective: every active rank adds 1 (the result is the world size)."""
    dist.init_process_group("gloo")
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


def flaky_host(qfile: str, how: str) -> dict[str, Any]:
    """4 ranks, 3 active: initial rank 1 faults (``how``: raises, a NaN loss through
    ``call.check_finite``, hangs in a sleep past ``soft_timeout``, or raises while its peers
    wait in a collective and leaves the group in a ``finally`` before its error goes up, so
    that the peers' failed collectives reach the store first) whenever it is active."""

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(3),
        quarantine=tr.Quarantine(after=2, window=3600, readmit="never", probes=[], file=qfile),
        sidecar=False,
        barrier_timeout=60,
        completion_timeout=60,
        soft_timeout=2,
        heartbeat_interval=0.5,
        heartbeat_timeout=5,
    )
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        _rounds.append(call.round)
        call.ping()
        total = _sum_of_ones()
        loss = torch.tensor(float("nan") if call.initial_rank == 1 else 0.5)
        if call.initial_rank == 1 and how == "raise":
            raise OSError("the GPU fell off the bus")
        if call.initial_rank == 1 and how == "hang":
            time.sleep(30)  # the watchdog ends it after soft_timeout
        if how == "leave":
            _raise_and_leave(call.initial_rank == 1)
        call.check_finite(loss)
        return {"round": call.round, "rank": call.rank, "sum": total}

    return {"value": train(), "rounds": list(_rounds)}


def _raise_and_leave(flaky: bool) -> None:
    """The peers enter a second collective; the flaky rank raises instead, destroys the group
    on its way out (their collective fails at once) and is slow to unwind."""
    if not flaky:
        dist.all_reduce(torch.ones(1))
        return
    try:
        raise OSError("the GPU fell off the bus")
    finally:
        dist.destroy_process_group()
        time.sleep(2)  # the peers' errors reach the store before this one


def software_bug(qfile: str) -> dict[str, Any]:
    """3 ranks, each on its own host, all raise the same error at the same place, every round
    and without progress."""

    @tr.Wrapper(
        quarantine=tr.Quarantine(after=2, window=3600, probes=[], file=qfile),
        sidecar=False,
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        _rounds.append(call.round)
        _sum_of_ones()  # together: every rank reaches the raise at about the same time
        raise ValueError("index out of range in the data loader")

    try:
        train()
    except RetryLimitError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "rounds": list(_rounds)}
    return {"error": None, "rounds": list(_rounds)}


def _marker_probe(marker: str) -> Any:
    def probe(state: object) -> None:
        if os.path.exists(marker):
            raise RuntimeError(f"marker {marker} is there")

    return probe


def readmitted(qfile: str, marker: str) -> dict[str, Any]:
    """4 ranks, 3 active: rank 1 faults in rounds 0 and 1 (its host is then out), rank 2 once
    in round 2 (the probe of host 1 fails: the marker is there), rank 0 removes the marker and
    faults once in round 3 (the probe passes: host 1 is back as a spare in round 4)."""

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(3),
        quarantine=tr.Quarantine(
            after=2, readmit=1, probes=[], health_check=_marker_probe(marker), file=qfile
        ),
        sidecar=False,
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        _rounds.append(call.round)
        call.ping()
        total = _sum_of_ones()
        who = call.initial_rank
        if who == 1 and call.round < 2:
            raise OSError("ECC error")
        if who == 2 and call.round == 2:
            raise RuntimeError("a one-off")
        if who == 0 and call.round == 3:
            Path(marker).unlink()
            raise KeyError("another one-off")
        return {"round": call.round, "rank": call.rank, "sum": total, "spares": call.state}

    value = train()
    state = value.pop("spares") if value else None
    if state is not None:
        value["spare_ranks"] = list(state.spare_ranks)
    return {"value": value, "rounds": list(_rounds)}


def too_few_left(qfile: str) -> dict[str, Any]:
    """2 ranks, no spare, at least 2 active: rank 1's host is quarantined after 2 faults."""

    @tr.Wrapper(
        quarantine=tr.Quarantine(after=2, probes=[], file=qfile),
        retry=tr.RetryController(min_active_world_size=2),
        sidecar=False,
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        call.ping()
        _sum_of_ones()
        if call.initial_rank == 1:
            raise OSError("link flaps")
        return call.round

    try:
        train()
    except RetryLimitError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


def dies(qfile: str) -> dict[str, Any]:
    """3 ranks, 2 active: initial rank 1's process ends (``os._exit``) in round 0."""

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(2),
        quarantine=tr.Quarantine(after=2, probes=[], file=qfile),
        barrier_timeout=60,
        completion_timeout=60,
    )
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        total = _sum_of_ones()
        if call.initial_rank == 1:
            os._exit(3)
        return {"round": call.round, "rank": call.rank, "sum": total}

    return {"value": train()}
