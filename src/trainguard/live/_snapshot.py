"""Peer snapshots: a host copy of this rank's local state, and the same bytes on a buddy rank.

Where no replica of a rank's shards exists (FSDP2 on a 1-D mesh, tensor parallelism without
data parallelism, a whole replica group lost), a killed or torn rank's shards survive only if
they were copied somewhere else first. With ``LiveState(snapshot_every=k)``, every ``k``-th
completed update (the state at a step divisible by ``k``) is copied, on every rank:

1. At the end of ``live.update(step)`` (main thread, :meth:`Snapshots.take`): the state's
   local form (:meth:`LiveState._outgoing`: DTensors as their local shards) is flattened
   (the skeleton, small values and the RNG state taken now) and a background thread starts.
   The previous own snapshot is dropped first: its buffers are reused.
2. The thread copies every tensor's bytes into host buffers kept from the last snapshot (the
   same names and sizes: no allocation in the steady state). A CUDA tensor goes into pinned
   host memory on a side stream that first waits for the stream current at step 1; a CPU
   tensor is a plain copy. Then this rank's own snapshot is at the step. The snapshot before
   it is kept (two generations, alternating buffers): until the new one has reached the
   buddy, the previous one is the newest that a lost buddy's copy can match.
3. The thread sends those bytes to this rank's buddy and receives the snapshot of the rank
   whose buddy it is (:mod:`._transfer`, checksummed, over a gloo group of its own made by
   :meth:`LiveState.recover`, so it never meets the training's collectives). The buddy is the
   next rank of a ring that alternates hosts (:func:`ring`): on another host wherever the
   round has one. The held snapshot is received into the buffers of the last one (one
   generation: from the moment the new one's header arrives until it is verified, this rank
   holds none; a buddy that died before sending leaves the last one held).

Consistency: the thread reads the live tensors while the next step's forward and backward run;
nothing writes into parameters or optimizer state there (FSDP2's all-gathers read the shards,
gradients are other tensors). The next ``live.update`` waits for the copy (and the transfer)
before ``optimizer.step()`` writes, and so does :meth:`LiveState.recover`. A job that writes
into its registered state outside ``live.update`` must not take snapshots.

Memory: two host copies of this rank's local state (the newest snapshot and the one before)
and one of its buddy's; the limit the user sets is checked when the first snapshot is sized (the buddy's share is taken as this rank's
own until one arrived; a larger one is refused when it arrives, at the next update).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainguard import _aborts
from trainguard.checkpoint.format import layout
from trainguard.errors import ConfigError
from trainguard.live import _transfer

__all__ = ["Snap", "Snapshots", "check_options", "ring"]

logger = logging.getLogger(__name__)

#: how long a snapshot transfer may wait for its peer (a peer that died fails at once)
TRANSFER_TIMEOUT = datetime.timedelta(seconds=120)
#: how long recover() waits for a transfer still in flight (one the fault cut off may wait for
#: a peer that will never send) before it leaves it behind: the held copy it did not start
#: to overwrite stays valid, and the thread can no longer touch it
JOIN_TIMEOUT = 1.0
_SLICE = 0.05  # seconds per wait slice


def check_options(every: Any, limit: Any) -> int:
    """``snapshot_every`` as an int (0: off); ConfigError naming the fix for bad values."""
    if every is None or (every == 0 and not isinstance(every, bool)):
        every = 0
    elif isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(
            f"LiveState(snapshot_every={every!r}): give the number of updates between peer "
            "snapshots (an int >= 1), or None (or 0) for none"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(
            f"LiveState(snapshot_memory_limit={limit!r}): give the host bytes the snapshots may "
            "take on each rank (an int >= 1), or None for no limit"
        )
    return int(every)


def ring(hosts: Sequence[int]) -> list[int]:
    """The ranks in snapshot order: ``hosts[r]`` is rank ``r``'s host (any id). Hosts with the
    most ranks first (ties: by id), one rank of each in turn, so that neighbours sit on
    different hosts wherever there are any (on one host: rank order). Rank ``order[i]``
    sends its snapshot to ``order[i + 1]`` (the last to the first)."""
    left: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        left.setdefault(host, []).append(rank)
    names = sorted(left, key=lambda h: (-len(left[h]), h))
    order: list[int] = []
    while len(order) < len(hosts):
        order += [left[h].pop(0) for h in names if left[h]]
    return order


@dataclasses.dataclass
class Snap:
    """One snapshot: the step its state is at, the replica group key of the rank it is of
    (the layout of its shards), and the state (a local form: plain tensors, host memory)."""

    step: int
    key: int
    state: Any
    nbytes: int


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class Snapshots:
    """One rank's peer snapshots (see the module docstring). Built by ``LiveState``; bound to
    each round by :meth:`bind` (from ``recover()``)."""

    def __init__(self, every: int, limit: int | None) -> None:
        self.every, self.limit = every, limit
        self.own: Snap | None = None
        self.prev: Snap | None = None  # the own snapshot before ``own``
        self.held: Snap | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._error: BaseException | None = None
        self._generation = 0  # a thread whose generation is gone writes nothing back
        self._group: Any = None
        self._to = self._from = -1  # ranks of the default group (-1: no buddy this round)
        self._key = 0
        self._held_key = 0
        self._sized = False
        #: totals since built: snapshots taken, seconds copying, seconds in transfers (the
        #: background thread's), seconds the main thread waited for them (``wait``)
        self.stats = {"snapshots": 0, "copy_s": 0.0, "transfer_s": 0.0, "waited_s": 0.0}

    def due(self, step: int) -> bool:
        """Whether the state at ``step`` is snapshotted."""
        return self.every > 0 and step % self.every == 0

    def bind(self, group: Any, to: int, frm: int, key: int, held_key: int) -> None:
        """This round's snapshot group, buddy (``to``), the rank it holds a copy of
        (``frm``), this rank's replica group key and ``frm``'s."""
        self._group, self._to, self._from = group, to, frm
        self._key, self._held_key = key, held_key

    def record(self) -> list[int]:
        """[own step, own key, previous own step, its key, held step, held key]; step -1
        where none is held."""
        with self._lock:
            snaps = [self.own, self.prev, self.held]
        out: list[int] = []
        for snap in snaps:
            out += [-1, 0] if snap is None else [snap.step, snap.key]
        return out

    def find(self, step: int, which: str) -> Snap | None:
        """The own (``which="own"``: the newest or the one before) or held snapshot of
        ``step``."""
        with self._lock:
            snaps = [self.own, self.prev] if which == "own" else [self.held]
        return next((s for s in snaps if s is not None and s.step == step), None)

    def take(self, outgoing: Any, step: int) -> None:
        """Start the snapshot of ``outgoing`` (the state's local form) at ``step``."""
        self.wait()
        flat = layout.flatten(outgoing, allow_sharded=False)
        self._check_memory(flat.nbytes)
        with self._lock:
            old, self.prev, self.own = self.prev, self.own, None  # old's buffers are reused
            self._generation += 1
            generation = self._generation
        reuse = {} if old is None else _buffers(old.state)
        event = None
        if torch.cuda.is_available() and any(e.source.is_cuda for e in flat.entries):
            event = torch.cuda.Event()
            event.record()  # the side stream waits for what the step queued
        self._copied.clear()
        self._error = None
        self._thread = threading.Thread(
            target=self._run,
            args=(flat, reuse, step, generation, event, _aborts.count()),
            name="trainguard-live-snapshot",
            daemon=True,
        )
        self._thread.start()

    def _check_memory(self, own: int) -> None:
        if self.limit is None or self._sized:
            return
        held = own if self.held is None else self.held.nbytes
        if 2 * own + held > self.limit:
            raise ConfigError(
                f"peer snapshots need {2 * own + held} bytes of host memory on this rank (two "
                f"of its own state's {own}, the newest and the one before, and its buddy's "
                f"{held}), over "
                f"LiveState(snapshot_memory_limit={self.limit}): raise the limit, take "
                f"snapshots less often (they still need it), or turn them off "
                f"(snapshot_every=None)"
            )
        self._sized = True

    def _run(
        self, flat: Any, reuse: dict[str, torch.Tensor], step: int, gen: int, event: Any, n: int
    ) -> None:
        began = time.monotonic()
        try:
            data = _copy(flat.entries, reuse, event)
            copied = time.monotonic()
            self.stats["snapshots"] += 1
            self.stats["copy_s"] += copied - began
            snap = Snap(step, self._key, layout.unflatten(flat.skeleton, data), flat.nbytes)
            with self._lock:
                if gen == self._generation:
                    self.own = snap
            self._copied.set()
            if self._group is not None and self._to >= 0:
                self._exchange(snap, gen)
                self.stats["transfer_s"] += time.monotonic() - copied
        except BaseException as exc:  # kept for the main thread; an abort's are expected
            self._error = exc
            # a peer that failed ends the transfer first (its round is ending): the next
            # recovery says whether it mattered; a memory refusal is raised by the next update
            refused = isinstance(exc, ConfigError)
            level = logging.WARNING if refused else logging.INFO
            level = logging.DEBUG if _aborts.count() != n else level
            logger.log(level, "live state: peer snapshot of step %d failed: %s", step, exc)
        finally:
            self._copied.set()

    def _exchange(self, snap: Snap, gen: int) -> None:
        """Send ``snap`` to the buddy, receive the snapshot this rank holds for another."""
        old = self.held
        out = _transfer.prepare(snap.state, snap.step)
        works = _transfer.send(out, self._to, group=self._group)
        into = {} if old is None else _transfer.own_bytes(old.state)

        def ready() -> None:  # the buddy's bytes go into the held one's buffers from now on
            with self._lock:
                if gen != self._generation:  # left behind by recover(): touch nothing
                    raise RuntimeError("a snapshot transfer of a round that ended")
                self.held = None

        got = _transfer.receive(self._from, snap.step, group=self._group, into=into, ready=ready)
        for work in works:
            work.wait()
        if got.problem is not None:
            raise RuntimeError(got.problem)
        if self.limit is not None and 2 * snap.nbytes + got.nbytes > self.limit:
            raise ConfigError(
                f"the buddy's peer snapshot ({got.nbytes} bytes) and two of this rank's "
                f"({snap.nbytes}) exceed LiveState(snapshot_memory_limit={self.limit}): "
                "raise the limit or turn snapshots off (snapshot_every=None)"
            )
        with self._lock:
            if gen == self._generation:
                self.held = Snap(snap.step, self._held_key, got.state, got.nbytes)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the snapshot in flight (the copy always; the transfer up to ``timeout``
        seconds, None: for good). False when a transfer was left behind: its thread writes
        nothing back from then on (a held copy it had not begun to overwrite stays held; one
        it had is already dropped). Raises a memory refusal of the thread."""
        thread = self._thread
        if thread is None:
            return True
        began = time.monotonic()
        # in slices: a restart's interrupt of this (main) thread lands between them
        while not self._copied.wait(_SLICE):
            pass
        end = None if timeout is None else time.monotonic() + timeout
        while thread.is_alive() and (end is None or time.monotonic() < end):
            thread.join(_SLICE if end is None else max(0.0, min(_SLICE, end - time.monotonic())))
        self.stats["waited_s"] += time.monotonic() - began
        if thread.is_alive():
            with self._lock:
                self._generation += 1
            self._thread = None
            logger.info("live state: a peer snapshot transfer did not finish; left behind")
            return False
        self._thread = None
        if isinstance(self._error, ConfigError):
            error, self._error = self._error, None
            raise error
        return True

    def forget(self, snap: Snap) -> None:
        """``snap``'s tensors were handed to the state (a rollback): never reused."""
        with self._lock:
            if self.own is snap:
                self.own = None
            if self.prev is snap:
                self.prev = None


def _buffers(state: Any) -> dict[str, torch.Tensor]:
    """Entry name -> the 1-D ``uint8`` bytes of each tensor of a snapshot's state."""
    return {
        e.name: e.source.reshape(-1).view(torch.uint8)
        for e in layout.flatten(state, allow_sharded=False).entries
    }


def _copy(entries: Any, reuse: dict[str, torch.Tensor], event: Any) -> dict[str, torch.Tensor]:
    """Each entry's bytes copied into host memory (a reused buffer of the same size where
    there is one): CUDA tensors into pinned buffers on a side stream, CPU ones plainly."""
    cuda = [e for e in entries if e.source.is_cuda]
    stream = torch.cuda.Stream() if cuda else None
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        buf = reuse.get(e.name)
        if buf is None or buf.numel() != e.nbytes or (e.source.is_cuda and not buf.is_pinned()):
            buf = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=e.source.is_cuda)
        out[e.name] = buf
    if stream is not None:
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            for e in cuda:
                out[e.name].copy_(_bytes_of(e.source), non_blocking=True)
        stream.synchronize()
    for e in entries:
        if not e.source.is_cuda:
            out[e.name].copy_(_bytes_of(e.source))
    return out


def new_group(group: Any) -> Any:
    """The snapshots' own gloo group over the ranks of ``group`` (a collective on it)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=TRANSFER_TIMEOUT)
