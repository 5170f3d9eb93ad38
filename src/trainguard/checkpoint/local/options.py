"""The settings of :class:`~.manager.LocalCheckpointManager`: one keyword-only dataclass,
checked when it is built.

:class:`LocalOptions` holds what the manager's keyword arguments set, besides its ``root`` and
the ``store`` it binds to. The constructor builds one from its keywords, or takes one as
``options=``. A bad value raises :class:`~trainguard.errors.ConfigError` naming the fix, when
the options are built; the settings it shares with the asynchronous checkpointer are checked
as there (:mod:`trainguard.checkpoint.options`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from trainguard._settings import Converted, Seconds
from trainguard.checkpoint import _onerror
from trainguard.checkpoint.local.replication import CliqueReplication
from trainguard.checkpoint.options import check_shared
from trainguard.errors import ConfigError

__all__ = ["LocalOptions"]

_BACKENDS = (None, "gloo", "nccl")


def _roots(name: str, roots: Sequence[str | os.PathLike[str]] | None) -> tuple[str, ...] | None:
    if roots is None:
        return None
    if isinstance(roots, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"{name}={roots!r}: give a list of directories ({name}=[{roots!r}]), not one path"
        )
    out = []
    for root in roots:
        path = os.fspath(root) if isinstance(root, (str, os.PathLike)) else None
        if not isinstance(path, str):
            raise ConfigError(
                f"{name}={roots!r}: give a list of directory paths (str or os.PathLike)"
            )
        out.append(path)
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalOptions:
    """The settings of a :class:`~trainguard.checkpoint.LocalCheckpointManager` (immutable).

    Keyword-only; a bad value raises :class:`~trainguard.errors.ConfigError` naming the fix.
    Timeouts take seconds or a ``timedelta`` and read back as float seconds; they have no order
    to check (a spare's ``spare_interval`` is how often it looks, unrelated to ``timeout``).
    ``spare_roots`` reads back as a tuple of paths (or None).
    """

    replication: CliqueReplication | None = None
    """A :class:`~trainguard.checkpoint.CliqueReplication`, or None for one copy per part."""
    keep: int = 2
    """Complete iterations to keep (at least 1)."""
    backend: str | None = None
    """Transport of the copies, a dedicated group: ``"gloo"`` (None: the default) or
    ``"nccl"``."""
    timeout: Seconds = Seconds(300.0)
    """How long a rank waits for the others (store operations and transfers)."""
    staging_threads: int | None = None
    """Threads that copy the state into the staging buffer (None: up to 4)."""
    pin_memory: bool = True
    """Register the staging buffers as pinned memory when CUDA is available."""
    fsync: bool = True
    """Make files durable (turn it off only to benchmark memory-only storage)."""
    writer_nice: int = 10
    """Nice increment of the writer process (0 to 19)."""
    allow_replication_change: bool = False
    """Load iterations saved with another replication setting instead of raising
    :class:`~trainguard.errors.CheckpointReplicationMismatchError`."""
    key_prefix: str = "trainguard/local"
    """Prefix of the manager's store keys."""
    spare_roots: Converted[Sequence[str | os.PathLike[str]] | None, tuple[str, ...] | None] = (
        Converted(None, _roots)
    )
    """Other ranks' roots this process can read, to prefetch from while it is a spare (costs
    one iteration's parts of those roots in its own root); None: off."""
    spare_interval: Seconds = Seconds(1.0)
    """How often a spare looks for a newer iteration under ``spare_roots``."""
    on_error: str = "report"
    """A save that fails in the background (disk full, a killed writer, a failed copy):
    ``"report"`` logs it, emits ``ckpt_failure`` and keeps it in ``failures`` while training
    goes on and the next save retries; ``"raise"`` raises it at the next ``save``/``wait``.
    See :mod:`trainguard.checkpoint._onerror`."""

    def __post_init__(self) -> None:
        replication = self.replication
        if replication is not None and not isinstance(replication, CliqueReplication):
            raise ConfigError(
                f"replication={replication!r}: pass CliqueReplication(factor, jump), or None "
                "for one copy per part"
            )
        keep = self.keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep={keep!r}: keep at least 1 complete iteration")
        if self.backend not in _BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend='nccl' needs CUDA; use backend='gloo'")
        if not isinstance(self.allow_replication_change, bool):
            raise ConfigError(
                f"allow_replication_change={self.allow_replication_change!r}: pass True or False"
            )
        check_shared(self)
        _onerror.check(self.on_error)
