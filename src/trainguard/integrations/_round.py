"""What a framework integration opened in this restart round, and how the round ends.

Callbacks and plugins are built inside the wrapped function, once per round; on a fault the
Wrapper unwinds the function and then calls its ``finalize``. :func:`track` records the
checkpointers they open, so that :func:`release_round` (the ``finalize`` the integrations
document) can close them and the round's process group without the caller holding on to them.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from trainguard import _timeouts
from trainguard.errors import ConfigError

if TYPE_CHECKING:
    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

_lock = threading.Lock()
_open: list[Any] = []  # this process's checkpointers opened by an integration, oldest first
_lives: dict[str, tuple[Any, Captured]] = {}  # root -> (LiveState, what it keeps), across rounds


class Captured:
    """What a framework callback's :class:`~trainguard.live.LiveState` keeps: the state of the
    newest completed step as the framework resumes from it (the same dict a local checkpoint
    of that step holds). Its tensors are the live ones (no copy): they stay at that step until
    the next optimizer update, which runs inside ``live.update`` (torn until it ends)."""

    def __init__(self) -> None:
        self.part: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.part if self.part is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part = state  # received from a replica (a spare, a torn or a lagging rank)


def live_for(root: str) -> tuple[Any, Captured]:
    """This process's live state of the callback writing under ``root``: made on first use and
    kept across restart rounds (the callbacks are built anew every round), until
    :func:`forget_live`."""
    from trainguard.live import LiveState

    with _lock:
        if root not in _lives:
            captured = Captured()
            _lives[root] = (LiveState(trainer=captured, rng=False), captured)
        return _lives[root]


def forget_live(root: str) -> None:
    """Drop the live state of ``root`` (the training ended: nothing left to recover)."""
    with _lock:
        _lives.pop(root, None)


def track(resource: Any) -> Any:
    """Remember ``resource`` (it has ``close()``) until it is closed here or untracked."""
    with _lock:
        _open.append(resource)
    return resource


def untrack(resource: Any) -> None:
    """Forget ``resource`` (its owner closed it)."""
    with _lock:
        if resource in _open:
            _open.remove(resource)


def release_round(*_: Any, strict: bool = False) -> None:
    """Close what the integrations opened in this process (newest first) and the process group.

    Pass it as the Wrapper's ``finalize`` (it ignores its arguments). After a fault the errors
    of closing are expected and ignored and a pending disk commit is abandoned; with ``strict``
    the first error is raised. Idempotent.
    """
    from trainguard._teardown import close_round

    with _lock:
        resources = list(_open)
        _open.clear()
    close_round(resources, strict=strict)


def check_schedule(every_n_steps: Any, replication: Any, keep: Any, timeout: Any) -> None:
    """Raise :class:`ConfigError` for a checkpoint schedule a callback cannot run."""
    from trainguard.checkpoint.local.replication import CliqueReplication

    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
        raise ConfigError(f"every_n_steps={every_n_steps!r}: use a positive integer")
    if replication is not None and not isinstance(replication, CliqueReplication):
        raise ConfigError("replication must be a CliqueReplication(factor, jump) or None")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r}: keep at least 1 complete iteration")
    _timeouts.seconds("timeout", timeout)


class LocalSchedule:
    """The local-checkpoint part of a framework callback: where, how often, which manager.

    Args:
        root: this rank's local directory (``/dev/shm/...`` or a local NVMe).
        every_n_steps: save after every this many optimizer steps.
        replication: a :class:`~trainguard.checkpoint.CliqueReplication`, or None (one copy).
        keep: complete iterations to keep.
        timeout: how long a rank waits for the others (seconds or a ``timedelta``).
        **manager: other keyword arguments of ``LocalCheckpointManager`` (``fsync``, ...).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every_n_steps: int,
        *,
        replication: CliqueReplication | None = None,
        keep: int = 2,
        timeout: _timeouts.Timeout = 300.0,
        **manager: Any,
    ) -> None:
        check_schedule(every_n_steps, replication, keep, timeout)
        self.root = os.fspath(root)
        self.every_n_steps = every_n_steps
        self._options = {"replication": replication, "keep": keep, "timeout": timeout, **manager}
        self.manager: LocalCheckpointManager | None = None
        #: The step (iteration) this run resumed from, or None.
        self.resumed_from: int | None = None
        self._saved = -1

    def _open(self) -> LocalCheckpointManager:
        """The manager, opened (every rank together) on first use and tracked for the round."""
        from trainguard.checkpoint import LocalCheckpointManager

        if self.manager is None:
            self.manager = track(LocalCheckpointManager(self.root, **self._options))
        return self.manager
