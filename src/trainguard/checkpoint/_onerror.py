"""What a checkpointer does with a save that failed in the background: report it, or raise it.

A save fails after ``save()`` returned when the disk fills, a permission is missing, the
writer process is killed, a copy to a peer fails or another rank's part never comes. Raising
that in the training loop (the next ``poll``/``save``/``wait``) ends the restart round and
rolls every rank back to the last checkpoint: a failed *save* then costs training progress,
although nothing about the training state is wrong. So by default (``on_error="report"``) the
failure is reported instead: a warning names the save and its cause, a ``ckpt_failure`` event
records it (``trainguard report`` counts them), the checkpointer keeps it in ``failures``,
training goes on, and the next save tries again. The previous committed checkpoint stays the
latest in every case (a failed save never commits and never removes one).
``on_error="raise"`` keeps the old behaviour: the failure is raised as
:class:`~trainguard.errors.CheckpointWriteError` where the training thread next meets the
checkpointer.

Errors of the call itself (bad arguments, a state that cannot be saved, ``overwrite=False``
refusing a committed path) are raised at ``save()`` either way: they are the caller's to fix.
"""

from __future__ import annotations

import logging

from trainguard import events
from trainguard.errors import CheckpointError, ConfigError

__all__ = ["ON_ERROR", "FailurePolicy", "check"]

logger = logging.getLogger(__name__)

#: the accepted values of ``on_error``
ON_ERROR = ("report", "raise")


def check(value: object) -> None:
    """:class:`ConfigError` naming the fix unless ``value`` is one of :data:`ON_ERROR`."""
    if value not in ON_ERROR:
        raise ConfigError(
            f"on_error={value!r}: use 'report' (a failed background save is logged and "
            "counted, training goes on and the next save retries) or 'raise' (it is raised in "
            "the training loop)"
        )


class FailurePolicy:
    """One checkpointer's handling of its background failures (see the module docstring).

    Called by the training thread only, where the checkpointer would have raised: each
    failure is raised (``"raise"``) or reported and kept in :attr:`failures` (``"report"``).
    """

    def __init__(self, on_error: str, checkpointer: str) -> None:
        check(on_error)
        self.on_error = on_error
        self.checkpointer = checkpointer
        #: the failures reported so far, oldest first (``"report"`` only)
        self.failures: list[CheckpointError] = []

    def handle(self, error: CheckpointError) -> None:
        """Raise ``error``, or report it: a warning, a ``ckpt_failure`` event, :attr:`failures`."""
        if self.on_error == "raise":
            raise error
        self.failures.append(error)
        logger.warning(
            "%s: a checkpoint save failed (%s); training goes on, the previous committed "
            "checkpoint stays the latest and the next save tries again (on_error='raise' "
            "raises this instead)",
            self.checkpointer,
            error,
        )
        events.emit(
            "ckpt_failure",
            checkpointer=self.checkpointer,
            error=f"{type(error).__name__}: {error}",
            count=len(self.failures),
        )
