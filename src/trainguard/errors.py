"""The one exception tree of trainguard.

Every error the library raises on purpose derives from :class:`TrainguardError`::

    TrainguardError
    ├── ConfigError              bad arguments or environment; raised when an object is built
    │   └── UnsupportedTorchError  the installed torch is older than the supported range
    ├── CoordinationError        the coordination store misbehaved or a barrier timed out
    │   ├── StoreTimeoutError    a wait of trainguard's own store client ran out of time
    │   ├── BarrierTimeoutError  a barrier did not complete within its timeout
    │   └── NodeLeftError        this node left a launched job: it was declared lost and
    │                            does not rejoin, or it stayed cut off from the store
    ├── RestartError             in-process restart could not continue (too few ranks, ...)
    │   ├── NonFiniteError       call.check_finite found a non-finite loss or gradient on
    │   │                        this rank (a fault of the round, attributed to its host)
    │   ├── JobEndedError        another rank ended the job (KeyboardInterrupt, SystemExit)
    │   ├── RetryLimitError      the job must stop: max_rounds or min_active_world_size of
    │   │                        RetryController hit, max_repeated_faults alike faults in a
    │   │                        row, or no active rank left
    │   │   └── HostQuarantinedError  too few ranks left once the quarantined hosts
    │   │                            were taken out (the error names them and why)
    │   ├── SidecarLostError     this rank's sidecar process died; the rank left the job
    │   └── StragglerError       this rank stayed much slower than the others; the
    │                            straggler policy took it out of the job
    └── CheckpointError          a checkpoint could not be written, committed or loaded
        ├── CheckpointWriteError         staging, writing or committing failed (disk full,
        │                                permission denied, writer killed, a rank failed)
        ├── CheckpointCorruptError       a file is truncated, malformed or fails its checksum
        ├── CheckpointUncommittedError   a multi-rank checkpoint has no commit marker
        ├── CheckpointPickleError        a leaf needs pickle and pickle was not allowed
        ├── CheckpointNotFoundError      no complete local checkpoint can be recovered
        ├── CheckpointReplicationMismatchError
        │                                a local checkpoint was saved with another
        │                                replication setting
        └── WriterDied                   the checkpoint writer process ended or was killed
                                         while a job was pending (also a RuntimeError)

Every class of the tree is defined in this module. A failure that one rank detects surfaces
as the *same* type on every rank; ``causes`` maps each rank that reported a cause to a short
description of it, so the error reads the same wherever it is caught.

:class:`UntestedTorchWarning` (a ``UserWarning``) says the installed torch is newer than the
newest release trainguard was tested with.

Not an error and not in this tree: ``trainguard.restart.RestartInterrupt`` (a
``BaseException``) is raised inside the wrapped function to unwind it when a round is aborted;
the wrapper catches it. Nor is ``trainguard._aborts.RoundOver``: a store call that a
background thread did not send because its round was aborted; it never leaves the library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BarrierTimeoutError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointPickleError",
    "CheckpointReplicationMismatchError",
    "CheckpointUncommittedError",
    "CheckpointWriteError",
    "ConfigError",
    "CoordinationError",
    "HostQuarantinedError",
    "JobEndedError",
    "NodeLeftError",
    "NonFiniteError",
    "RestartError",
    "RetryLimitError",
    "SidecarLostError",
    "StoreTimeoutError",
    "StragglerError",
    "TrainguardError",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "WriterDied",
]


class TrainguardError(Exception):
    """Root of every error trainguard raises.

    Args:
        message: what went wrong and what to do about it.
        causes: optional mapping rank -> description of that rank's cause.
    """

    def __init__(self, message: str = "", *, causes: Mapping[int, str] | None = None) -> None:
        self.causes: dict[int, str] = dict(causes or {})
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        if not self.causes:
            return self.message
        lines = [self.message] if self.message else []
        for rank in sorted(self.causes):
            lines.append(f"  rank {rank}: {self.causes[rank]}")
        return "\n".join(lines)

    def __reduce__(
        self,
    ) -> tuple[Any, ...]:  # keep `causes` when the error crosses a process boundary
        return (_rebuild, (type(self), self.message, self.causes))


def _rebuild(cls: type[TrainguardError], message: str, causes: dict[int, str]) -> TrainguardError:
    err = cls.__new__(cls)
    TrainguardError.__init__(err, message, causes=causes)
    return err


class ConfigError(TrainguardError, ValueError):
    """An argument, a combination of arguments or an environment variable is invalid.

    Raised when the object is built, never at the first fault. The message names the fix.
    """


class UnsupportedTorchError(ConfigError):
    """The installed torch is older than the oldest release trainguard supports; the message
    names the version needed (see :mod:`trainguard._torchcompat`)."""


class UntestedTorchWarning(UserWarning):
    """The installed torch is newer than the newest release trainguard was tested with."""


class CoordinationError(TrainguardError):
    """The coordination store could not be reached, or a barrier did not complete in time."""


class RestartError(TrainguardError):
    """In-process restart cannot go on (for example too few ranks are left)."""


class StoreTimeoutError(CoordinationError):
    """A store wait (or a ``get`` of a key never set) ran out of time through trainguard's own
    store client (the torch-free one of helper processes); the connection stays usable.
    :func:`trainguard.coord.timed_out` is True for it, as for torch's ``DistStoreError``."""


class BarrierTimeoutError(CoordinationError):
    """A barrier of the coordination layer did not complete within its timeout."""


class NodeLeftError(CoordinationError):
    """This node left a job of ``trainguard launch`` while the job goes on without it: the other
    nodes declared it lost and it does not rejoin (``--tg-on-evicted exit``, or no free place
    was left), or it could not reach the coordination store for ``--tg-fence-timeout``. The
    launcher exits with status 3 (:data:`trainguard.launch.cli.EXIT_LEFT`)."""


class JobEndedError(RestartError):
    """Another rank ended the job with an exception that is never restarted.

    ``KeyboardInterrupt`` or ``SystemExit`` on one rank ends the job on every rank: that rank
    re-raises its own exception, every other rank raises this error naming it in ``causes``.
    """


class RetryLimitError(RestartError):
    """The retry controller stopped the job: too many rounds, or too few active ranks left."""


class HostQuarantinedError(RetryLimitError):
    """The job cannot go on without the quarantined hosts (too few ranks are left); the message
    names each host and the faults that took it out."""


class NonFiniteError(RestartError):
    """``call.check_finite`` found a NaN or infinity on this rank: a fault of the round."""


class SidecarLostError(RestartError):
    """This rank's sidecar process died: the rank left the job rather than run unwatched."""


class StragglerError(RestartError):
    """This rank stayed slower than the others for too long: the straggler policy
    (:class:`~trainguard.stragglers.TakeOutStragglers`) took it out of the job, and a spare
    takes its number at the next round."""


class CheckpointError(TrainguardError):
    """A checkpoint could not be staged, written, committed, verified or loaded."""


class CheckpointWriteError(CheckpointError):
    """A save failed in the background: staging, the writer process, the file system, or the
    commit (another rank failed). Raised by the next ``poll``/``wait``/``save`` on every rank,
    with ``causes`` naming each failed rank's reason. The next save may be tried again."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated or malformed, or a tensor fails its checksum (the message
    names the tensor)."""


class CheckpointUncommittedError(CheckpointError):
    """A multi-rank checkpoint directory has no commit marker: some rank's part never became
    durable. Load it anyway with ``allow_uncommitted=True``."""


class CheckpointPickleError(CheckpointError):
    """A leaf of the state is neither a tensor nor JSON-representable, or a file holds pickled
    leaves, and pickle was not allowed (``pickle=True`` on save, ``allow_pickle=True`` on load).
    The message names the key."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint can be recovered: for every iteration found, the part of some
    owner has no good copy on any live rank (the message names the missing parts)."""


class CheckpointReplicationMismatchError(CheckpointError):
    """A local checkpoint was saved with another replication setting than the manager's. The
    message names both settings and the ways out (same setting, ``allow_replication_change``,
    or a fresh root)."""


class WriterDied(CheckpointError, RuntimeError):
    """The checkpoint writer process ended (or was killed because it did not finish in time)
    while a job was pending. The checkpointers turn it into a failed save and start a new
    writer for the next one. Also a ``RuntimeError``, as it was before it joined this tree."""
