"""Restore from memory: this rank's newest part is still in its staging buffer.

After an exception or a hang the process survives, and so does the shared-memory buffer its
last :meth:`~.manager.LocalCheckpointManager.save` staged into (the buffer is only reused by
the next save). When that save is the iteration every rank resumes from, and this rank's part
of it was written durably from that very buffer, the file holds the same bytes: ``load`` then
rebuilds the state from the buffer instead of reading and hashing the file again. The result
is bit-identical to a file load (the same skeleton, as JSON, and the same data section); the
files stay the fallback whenever any of these conditions does not hold.
"""

from __future__ import annotations

import dataclasses
import json
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

    def restore(self, *, allow_pickle: bool) -> Any:
        """The state, every tensor in memory of its own (the buffer is reused by the next
        save), as :func:`~trainguard.checkpoint.fileformat.load_file` would rebuild it."""
        job = self.job
        skeleton = json.loads(json.dumps(job.skeleton, separators=(",", ":")))
        tensors = {
            p.name: job.buffer.view(p.offset, p.nbytes).clone()
            if p.nbytes
            else torch.empty(0, dtype=torch.uint8)
            for p in job.placed
        }
        return unflatten(skeleton, tensors, allow_pickle=allow_pickle)

    @property
    def nbytes(self) -> int:
        return self.job.nbytes
