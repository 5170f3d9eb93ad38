"""What a framework integration opened in this restart round, and how the round ends.

Callbacks and plugins are built inside the wrapped function, once per round; on a fault the
Wrapper unwinds the function and then calls its ``finalize``. :func:`track` records the
checkpointers they open, so that :func:`release_round` (the ``finalize`` the integrations
document) can close them and the round's process group without the caller holding on to them.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_open: list[Any] = []  # this process's checkpointers opened by an integration, oldest first


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
    from trainguard.demo.worker import close_round

    with _lock:
        resources = list(_open)
        _open.clear()
    close_round(resources, strict=strict)
