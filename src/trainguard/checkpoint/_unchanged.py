"""A save whose tensors are byte-identical to the previous save's, reported.

An asynchronous checkpoint can go stale without any error: a save that snapshots tensors that
training no longer updates (a copy of the model taken once, a state dict of the wrong object,
an optimizer whose parameters were replaced) writes a valid checkpoint every time, each one
the same as the last, and the loss shows up only when a job resumes from it weeks later. So
after each durable save, this rank's file's per-tensor checksums (xxh3, already in its header:
no extra pass over the data) are compared with the previous durable save's. When every tensor
is the same, and the save went to another path (a new step), a warning names both saves and a
``ckpt_unchanged`` event records it. A state without tensors, a ``format="torch"`` file (no
checksums) or a save to the same path is never reported.

Runs on the checkpointer's background thread, after the file is durable; it never fails a
save (a header it cannot read is skipped).
"""

from __future__ import annotations

import logging

from trainguard import events
from trainguard.checkpoint.format.read import read_header
from trainguard.errors import CheckpointError

__all__ = ["UnchangedWatch"]

logger = logging.getLogger(__name__)


class UnchangedWatch:
    """Compares each durable save of one rank with the previous one (module docstring)."""

    def __init__(self) -> None:
        self._last: tuple[str, tuple[tuple[str, str], ...]] | None = None

    def durable(self, path: str, file: str) -> bool:
        """This rank's ``file`` of the save to ``path`` is durable; True when it was reported
        as unchanged."""
        try:
            header = read_header(file)
            if not header.is_trainguard:
                return False
            sums = tuple(sorted(header.checksums().items()))
        except (OSError, CheckpointError, ValueError):
            return False
        last, self._last = self._last, (path, sums)
        if not sums or last is None or last[0] == path or last[1] != sums:
            return False
        logger.warning(
            "checkpoint %s holds exactly the same tensors as the previous save %s (every "
            "checksum equal): is the state being saved the one training updates?",
            path,
            last[0],
        )
        events.emit("ckpt_unchanged", path=path, previous=last[0], tensors=len(sums))
        return True
