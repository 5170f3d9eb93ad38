"""Restore from memory: this rank's newest part is still in its staging buffer.

After an exception or a hang the process survives, and so does the shared-memory buffer its
last :meth:`~.manager.LocalCheckpointManager.save` staged into (the buffer is only reused by
the next save). When that save is the iteration every rank resumes from, and this rank's part
of it was written durably from that very buffer, the file holds the same bytes: ``load`` then
rebuilds the state from the buffer instead of reading and hashing the file again. The result
is bit-identical to a file load (the same skeleton, as JSON, and the same data section); the
files stay the fallback whenever any of these conditions does not hold.

The staging buffer is reused by the next save, so the restored tensors cannot be views of it:
the data section is copied, in one copy, into a :class:`RestoreBuffer` that is kept and reused
by the next restore once no tensor of the previous one is alive (copying into memory already
touched costs a fraction of copying into fresh memory, which pays a page fault per page).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import sys
import time
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint.format.layout import unflatten
from trainguard.checkpoint.local._pipeline import StagedSave


@dataclasses.dataclass(frozen=True)
class Remembered:
    """The save whose state the staging buffer holds: ``owner``'s part of ``iteration``."""

    iteration: int
    owner: int
    job: StagedSave

    def usable(self, iteration: int, owner: int) -> bool:
        """Whether it holds ``owner``'s part of ``iteration``, written to its file from this
        buffer (so the buffer and the file hold the same bytes)."""
        job = self.job
        return (
            self.iteration == iteration
            and self.owner == owner
            and job.done.is_set()
            and job.own_written
            and job.buffer.tensor is not None
        )

    def restore(self, into: RestoreBuffer, *, allow_pickle: bool) -> Any:
        """The state, as :func:`~trainguard.checkpoint.format.read.load_file` would rebuild it:
        each tensor a view of ``into`` with a storage of its own that starts at its first byte
        (some torch functions, ``torch.set_rng_state`` among them, ignore storage offsets)."""
        job = self.job
        skeleton = json.loads(json.dumps(job.skeleton, separators=(",", ":")))
        mm = into.take(job.nbytes)
        if job.nbytes:
            whole = torch.frombuffer(mm, dtype=torch.uint8, count=job.nbytes)
            whole.copy_(job.buffer.view(0, job.nbytes))
            del whole  # only the state's tensors may hold the buffer (see RestoreBuffer.take)
        tensors = {
            p.name: torch.frombuffer(mm, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
            if p.nbytes
            else torch.empty(0, dtype=torch.uint8)
            for p in job.placed
        }
        return unflatten(skeleton, tensors, allow_pickle=allow_pickle)

    @property
    def nbytes(self) -> int:
        return self.job.nbytes


class RestoreBuffer:
    """The memory the tensors of a restore from memory are views of, reused when free."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None

    def take(self, nbytes: int) -> mmap.mmap:
        """A buffer of at least ``nbytes``: the previous one when it is large enough and no
        tensor uses it any more (a tensor made by ``torch.frombuffer`` holds a reference to
        it), else a new one (the old one is freed with its last tensor)."""
        mm = self._mm
        # the references counted: self._mm, mm, and getrefcount's argument
        if mm is not None and len(mm) >= nbytes and sys.getrefcount(mm) <= 3:
            return mm
        self._mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        return self._mm

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # tensors still use it: freed with them
                mm.close()


def in_memory(remembered: Remembered | None, held: list[Any], rank: int) -> int | None:
    """The iteration this rank can restore from memory, for ``find_latest`` to report: its own
    part written from the staging buffer, and its file among the parts it holds (``held``:
    :class:`~._inventory.Part`)."""
    if remembered is None or not remembered.usable(remembered.iteration, rank):
        return None
    mine = any(p.iteration == remembered.iteration and p.owner == rank for p in held)
    return remembered.iteration if mine else None


@dataclasses.dataclass(frozen=True)
class MemoryRound:
    """``find_latest`` found ``iteration``, which every rank reported it can restore from
    memory, at the manager's ``calls``-th exchange and ``seq``-th save of the round.

    A :meth:`~.manager.LocalCheckpointManager.load` of that iteration called next (no exchange
    and no save in between: the same on every rank, since they call the same methods in the
    same order) restores from memory with no exchange at all: no rank reads a file or needs a
    transfer, so no copy can fail its checksum and there is nothing to agree on."""

    iteration: int
    calls: int
    seq: int

    @classmethod
    def of(
        cls, values: dict[int, Any], found: int | None, world_size: int, calls: int, seq: int
    ) -> MemoryRound | None:
        """From the ``find`` exchange's ``values`` (rank -> ``[in_memory, parts]``)."""
        if found is None or any(values[r][0] != found for r in range(world_size)):
            return None
        return cls(found, calls, seq)

    def applies(self, iteration: int, calls: int, seq: int) -> bool:
        return (self.iteration, self.calls, self.seq) == (iteration, calls, seq)

    def restore(
        self, remembered: Remembered | None, into: RestoreBuffer, allow_pickle: bool, started: float
    ) -> tuple[Any, dict[str, Any]]:
        """The state and ``last_load``; emits the ``local_ckpt_load`` event (``exchanges=0``)."""
        assert remembered is not None  # only a save changes it, and applies() saw none since
        state = remembered.restore(into, allow_pickle=allow_pickle)
        it, nbytes = self.iteration, remembered.nbytes
        fields = {"iteration": it, "requested": it, "bytes": nbytes, "source": "memory"}
        fields.update(copy="memory", transfers=0, attempts=1, exchanges=0)
        events.emit("local_ckpt_load", duration=time.monotonic() - started, **fields)
        return state, {"iteration": self.iteration, "source": "memory", "bytes": remembered.nbytes}
