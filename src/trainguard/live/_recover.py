"""The recovery collective: exchange records, agree (:mod:`._plan`), transfer (:mod:`._transfer`).

Every rank of the round runs :func:`run` once, in the same order, before any other collective
on ``group``:

1. all-gather of each rank's record (step, torn, replica group key) as three int64 values
   (the key holds the layout of a rank's DTensor shards, :mod:`._sharded`);
2. every rank computes the same :class:`._plan.Plan`; a rank at the agreed step moves its
   state into the round's rebuilt objects, if any; every other rank is torn from here on (it
   receives, or loads a checkpoint); a fallback ends here on every rank;
3. pass ``a`` (0 first): each receiver still pending receives from its ``a``-th donor; each
   donor sends to the receivers that picked it (in parallel); every receiver checks what it
   got; an all-reduce of one flag per rank says which receivers are still pending; with no
   donor left for one of them, every rank falls back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
import xxhash

from trainguard import events
from trainguard.checkpoint.local.replication import this_host
from trainguard.live import _snapshot, _transfer
from trainguard.live._outcome import Recovery
from trainguard.live._plan import (
    FIRST_START,
    NO_STEP,
    GroupKey,
    Plan,
    Record,
    SnapPlan,
    plan,
    snapshot_plan,
)

__all__ = ["report", "run"]

logger = logging.getLogger("trainguard.live")


class LiveState(Protocol):
    """What recovery asks of :class:`trainguard.live.LiveState` (typed here, so that this module
    never imports the state's module, which calls it)."""

    _tamper: Any

    def state_dict(self) -> dict[str, Any]: ...

    def group_key(self, rank: int, world_size: int) -> GroupKey: ...

    def _record(self) -> tuple[int | None, bool]: ...

    def _writing(self) -> None: ...

    def _layout(self) -> str: ...

    def _fits(self) -> bool: ...

    def _begin(self, keep: bool) -> None: ...

    def _outgoing(self) -> dict[str, Any]: ...

    def _received(self, got: Any, step: int) -> str | None: ...

    def _snapshots(self) -> Any: ...

    def _restore_own(self, step: int) -> str | None: ...


def _key(key: GroupKey) -> int:
    if isinstance(key, int):
        return key
    return xxhash.xxh3_64_intdigest(key.encode()) >> 1  # fits an int64


def _records(live: LiveState, group: Any) -> tuple[int, list[Record]]:
    """Every rank's record. The group key joins the user's key and, for DTensor state, the
    layout of the local shards (equal on the ranks that hold the same shards). A rank whose
    state of the last round is sharded otherwise than this round's objects reports no step
    (marked torn, so that a round where nobody fits is not taken for a first start)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step, torn = live._record()
    if step is not None and not live._fits():
        step, torn = None, True
    key: GroupKey = live.group_key(rank, world)
    layout = live._layout()
    snaps = live._snapshots()
    if snaps is not None:
        snaps.wait(_snapshot.JOIN_TIMEOUT)  # the last round's snapshot, done or given up
    held = snaps.record() if snaps else [NO_STEP, 0] * 3
    mine = torch.tensor(
        [
            NO_STEP if step is None else step,
            int(torn),
            _key(f"{key!r}|{layout}") if layout else _key(key),
            *held,
            _key(this_host()),
            snaps.every if snaps else 0,
        ],
        dtype=torch.int64,
        device=_transfer.wire_device(group),  # NCCL alone: collectives of CUDA tensors only
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()  # one copy to the host
    return rank, [Record(r, int(t[0]), bool(t[1]), *map(int, t[2:])) for r, t in enumerate(rows)]


def _bind_snapshots(live: LiveState, rank: int, records: list[Record], group: Any) -> None:
    """Where any rank takes snapshots, every rank makes the round's snapshot group (a
    collective) and this rank's snapshots learn its buddy (:func:`._snapshot.ring`)."""
    if not any(r.every for r in records) or len(records) < 2:
        return
    snap_group = _snapshot.new_group(group)
    order = _snapshot.ring([r.host for r in records])
    at = order.index(rank)
    to, frm = order[(at + 1) % len(order)], order[at - 1]
    snaps = live._snapshots()
    if snaps is not None:
        snaps.bind(
            snap_group,
            _global(to, group),
            _global(frm, group),
            records[rank].group,
            records[frm].group,
        )


def run(live: LiveState, group: Any) -> Recovery:
    """One round's recovery on this rank (see the module docstring)."""
    if not dist.is_initialized():
        from trainguard.errors import ConfigError

        raise ConfigError(
            "live.recover() needs the round's process group: call "
            "torch.distributed.init_process_group() first"
        )
    rank, records = _records(live, group)
    _bind_snapshots(live, rank, records, group)
    agreed = plan(records, round=events.get_log().round)  # the round the Wrapper runs now
    tried = any(r.every for r in records) and any(r.step != NO_STEP or r.torn for r in records)
    if agreed.fallback is not None and tried:
        snap = snapshot_plan(records)
        if isinstance(snap, SnapPlan):
            return _from_snapshots(live, snap, rank, group)
        agreed = dataclasses.replace(agreed, fallback=f"{agreed.fallback}; {snap}")
    live._begin(agreed.fallback is None and rank not in agreed.receivers)
    if agreed.fallback is not None:
        return Recovery(None, agreed.fallback, agreed.newest, None)
    pending = list(agreed.receivers)
    t0 = time.monotonic()
    problems: list[str] = []
    source: int | None = None
    nbytes = attempt = 0
    while pending:
        if any(agreed.donor(r, attempt) is None for r in pending):
            why = "; ".join(problems) or "no donor left"
            reason = f"live transfer failed on every donor ({why})"
            live._writing()  # every rank loads a checkpoint next
            return Recovery(
                None,
                reason,
                agreed.newest,
                None,
                tuple(agreed.receivers),
                attempts=attempt,
                problems=tuple(problems),
                transfer_seconds=time.monotonic() - t0,
            )
        failed, got = _pass(live, agreed, pending, attempt, rank, group)
        nbytes += got
        if rank in pending and failed is None:
            source = agreed.donor(rank, attempt)
        flags = _failed(failed is not None, rank, len(records), group)
        if failed is not None:
            problems.append(failed)
        # every rank learns every failure's presence; the reasons stay with the receivers
        problems += [f"rank {r} refused a transfer" for r in pending if flags[r] and r != rank]
        pending = [r for r in pending if flags[r]]
        attempt += 1
    return Recovery(
        agreed.step,
        None,
        agreed.newest,
        agreed.newest - agreed.step,
        tuple(agreed.receivers),
        source,
        nbytes,
        attempt,
        tuple(problems),
        transfer_seconds=time.monotonic() - t0 if agreed.receivers else 0.0,
    )


def _pass(
    live: LiveState, agreed: Plan, pending: list[int], attempt: int, rank: int, group: Any
) -> tuple[str | None, int]:
    """One transfer pass: why this rank refused what it received (None: it took it, or
    received nothing) and how many bytes it received."""
    mine = [r for r in pending if agreed.donor(r, attempt) == rank]
    works: list[Any] = []
    if mine:
        state = live._outgoing()
        out = _transfer.prepare(state, agreed.step, device=_transfer.wire_device(group, state))
        for r in mine:
            works += _transfer.send(out, _global(r, group), group=group, tamper=live._tamper)
    problem: str | None = None
    nbytes = 0
    if rank in pending:
        donor = agreed.donor(rank, attempt)
        assert donor is not None
        # torn since the plan (live._begin): its own tensors take the bytes in place
        problem, nbytes = _take(live, donor, agreed.step, group)
    for work in works:
        work.wait()
    return problem, nbytes


def _take(live: LiveState, donor: int, step: int, group: Any) -> tuple[str | None, int]:
    """Receive the state at ``step`` from ``donor`` (a rank of ``group``) into this rank's own
    tensors and hand it to ``live``: why it was refused (None: taken) and the bytes received."""
    state = live._outgoing()
    into = _transfer.own_bytes(state)
    wire = _transfer.wire_device(group, state)
    got = _transfer.receive(_global(donor, group), step, group=group, into=into, device=wire)
    problem = got.problem if got.problem is not None else live._received(got.state, step)
    return problem, got.nbytes


def _failed(mine: bool, rank: int, world: int, group: Any) -> torch.Tensor:
    """Every rank's flag of a refused transfer (a collective over ``group``), on the host."""
    flags = torch.zeros(world, dtype=torch.int64)
    flags[rank] = int(mine)
    flags = flags.to(_transfer.wire_device(group))
    dist.all_reduce(flags, group=group)
    return flags.cpu()


def _from_snapshots(live: LiveState, snap: SnapPlan, rank: int, group: Any) -> Recovery:
    """Every rank to ``snap.step``: keepers keep, ranks with their own snapshot of it load it,
    the others receive their shards from a holder (its live state, own snapshot or the copy it
    holds for a buddy), checksummed as any transfer; a refused one falls back on every rank."""
    kind, donor, _ = snap.actions[rank]
    live._begin(kind == "keep")
    t0 = time.monotonic()
    wire = _transfer.wire_device(group, live._outgoing())  # by the live state, on every rank
    outs: dict[str, _transfer.Outgoing] = {}
    works: list[Any] = []
    for r in snap.receivers:
        _, d, what = snap.actions[r]
        if d == rank:
            if what not in outs:
                held = None if what == "live" else live._snapshots().find(snap.step, what)
                state = live._outgoing() if held is None else held.state
                outs[what] = _transfer.prepare(state, snap.step, device=wire)
            works += _transfer.send(outs[what], _global(r, group), group=group)
    problem: str | None = None
    nbytes = 0
    if kind == "own":
        problem = live._restore_own(snap.step)
    elif kind == "recv":
        problem, nbytes = _take(live, donor, snap.step, group)
    for work in works:
        work.wait()
    flags = _failed(problem is not None, rank, len(snap.actions), group)
    seconds = time.monotonic() - t0
    if int(flags.sum()):
        live._writing()  # every rank loads a checkpoint next
        failed = [r for r in range(len(flags)) if flags[r]]
        why = problem or f"ranks {failed} refused what they got"
        reason = f"the recovery from peer snapshots failed ({why})"
        return Recovery(
            None,
            reason,
            snap.newest,
            None,
            tuple(snap.receivers),
            attempts=1,
            problems=(why,),
            transfer_seconds=seconds,
        )
    return Recovery(
        snap.step,
        None,
        snap.newest,
        snap.newest - snap.step,
        tuple(snap.receivers),
        donor if kind == "recv" else None,
        nbytes,
        1,
        transfer_seconds=seconds,
        snapshot=True,
    )


def _global(rank: int, group: Any) -> int:
    """``rank`` of ``group`` as a rank of the default group (what send/recv take)."""
    return rank if group is None else int(dist.get_global_rank(group, rank))


def report(got: Recovery) -> None:
    """Log and emit the outcome (``live_recover``; a fallback also warns)."""
    events.emit(
        "live_recover",
        duration=got.seconds,
        outcome="live" if got.live else "fallback",
        source="live" if got.live else None,
        snapshot=got.snapshot,
        step=got.step,
        newest=got.newest,
        recomputed=got.recomputed,
        receivers=list(got.receivers),
        received_from=got.received_from,
        nbytes=got.nbytes,
        transfer=got.transfer_seconds,
        attempts=got.attempts,
        reason=got.fallback,
    )
    if got.fallback == FIRST_START:
        logger.info("live state: %s; load a checkpoint or start fresh", got.fallback)
    elif got.fallback is not None:
        logger.warning("live state: falling back to a checkpoint: %s", got.fallback)
    elif got.receivers:
        logger.info(
            "live state: resumed at step %d, ranks %s received it from replicas (%.3f s)",
            got.step,
            list(got.receivers),
            got.seconds,
        )
