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
from typing import Any

import torch

from trainguard.checkpoint.layout import unflatten
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
        """The state, as :func:`~trainguard.checkpoint.fileformat.load_file` would rebuild it:
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
