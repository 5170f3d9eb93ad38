"""The settings of :class:`~trainguard.checkpoint.AsyncCheckpointer`: one keyword-only dataclass,
checked when it is built.

:class:`AsyncOptions` holds what the checkpointer's keyword arguments set, besides what it binds
to (``store``, ``rank``, ``world_size``). The constructor builds one from its keywords, or takes
one as ``options=``. A bad value raises :class:`~trainguard.errors.ConfigError` naming the fix,
when the options are built. The checks both checkpointers share live here too
(:func:`check_shared`); the local manager's settings are
:class:`trainguard.checkpoint.local.LocalOptions`. Both are built as every settings object of
trainguard is (:mod:`trainguard._settings`). Importing this module needs no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard._settings import Seconds
from trainguard.checkpoint import _onerror
from trainguard.errors import ConfigError

__all__ = ["AsyncOptions", "check_shared"]


def _whole(name: str, value: object, low: int, high: int | None, fix: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{name}={value!r}: must be a whole number {bounds}; {fix}")


def check_shared(options: Any) -> None:
    """The checks of the settings both checkpointers have: ``staging_threads``,
    ``writer_nice``, ``pin_memory``, ``fsync`` and ``key_prefix``."""
    if options.staging_threads is not None:
        _whole(
            "staging_threads",
            options.staging_threads,
            1,
            None,
            "give the number of copy threads, or None for the default (up to 4)",
        )
    _whole(
        "writer_nice",
        options.writer_nice,
        0,
        19,
        "it is the writer process's nice increment (10 by default)",
    )
    for name in ("pin_memory", "fsync"):
        if not isinstance(getattr(options, name), bool):
            raise ConfigError(f"{name}={getattr(options, name)!r}: pass True or False")
    if not isinstance(options.key_prefix, str) or not options.key_prefix:
        raise ConfigError(
            f"key_prefix={options.key_prefix!r}: give a non-empty string (the prefix of the "
            "store keys; the default is right unless two checkpointers share a store)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """The settings of an :class:`~trainguard.checkpoint.AsyncCheckpointer` (immutable).

    Keyword-only; a bad value raises :class:`~trainguard.errors.ConfigError` naming the fix.
    Timeouts take seconds or a ``timedelta`` and read back as float seconds. There is no order
    among them to check: ``close_timeout`` bounds :meth:`close` alone (a commit still waiting for
    the other ranks then is given up), so it may well be shorter than ``commit_timeout``.
    """

    staging_threads: int | None = None
    """Threads that copy the state into the staging buffer (None: up to 4)."""
    pin_memory: bool = True
    """Register the staging buffers as pinned memory when CUDA is available."""
    fsync: bool = True
    """Make files durable (turn it off only to benchmark memory-only storage)."""
    commit_timeout: Seconds = Seconds(300.0)
    """How long a rank waits for the other ranks' parts before it fails the checkpoint."""
    writer_nice: int = 10
    """Nice increment of the writer process (0 to 19)."""
    start_timeout: Seconds = Seconds(120.0)
    """How long to wait for the writer process to start."""
    close_timeout: Seconds = Seconds(900.0)
    """How long ``close()`` waits for pending saves (writes and commits) before it kills the
    writer, fails them on every rank and raises."""
    key_prefix: str = "trainguard/ckpt"
    """Prefix of the store keys (every rank creates its checkpointers in the same order)."""
    on_error: str = "report"
    """A save that fails in the background (disk full, a killed writer, another rank's
    failure): ``"report"`` logs it, emits ``ckpt_failure`` and keeps it in ``failures`` while
    training goes on and the next save retries; ``"raise"`` raises it in the training loop
    (the next ``poll``/``save``/``wait``). See :mod:`trainguard.checkpoint._onerror`."""
    overwrite: bool = True
    """With several ranks, a save to a committed checkpoint replaces it safely: it is written
    beside it and swapped in once committed (:mod:`trainguard.checkpoint._overwrite`), so a
    crash at any moment leaves one complete checkpoint there. False refuses such a save
    (:class:`~trainguard.errors.CheckpointError`). A single process's file is always replaced
    atomically."""

    def __post_init__(self) -> None:
        check_shared(self)
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"overwrite={self.overwrite!r}: pass True or False")
        _onerror.check(self.on_error)
