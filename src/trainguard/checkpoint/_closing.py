"""What both checkpointers share about closing: ``with`` closes, never masking; and an object
dropped without ``close()`` still releases its writer process, threads and buffers."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound="Closing")


def _collected(name: str, release: Callable[..., object], *args: object) -> None:
    """Run ``release(*args)`` for a ``name`` that was garbage-collected without ``close()``.

    The collection may happen on one of the checkpointer's own threads (a collection runs on
    whichever thread triggers it), which ``release`` joins: then it runs on a thread of its own.
    """
    if threading.current_thread().name.startswith("trainguard-"):
        threading.Thread(
            target=_release, args=(name, release, *args), name="trainguard-release", daemon=True
        ).start()
    else:
        _release(name, release, *args)


def _release(name: str, release: Callable[..., object], *args: object) -> None:
    logger.warning(
        "a %s was garbage-collected without close(): releasing its writer process, threads "
        "and buffers now (call close(), or use it in a with-block)",
        name,
    )
    try:
        release(*args)
    except Exception as exc:
        logger.warning("releasing a %s that was not closed failed: %s", name, exc)


class Closing:
    """Base of an object with ``close()``: leaving a ``with`` block closes it.

    When the block raised, an error from ``close()`` is logged, not raised, so that it never
    replaces the exception already propagating. A subclass registers, once its resources
    exist, what frees them should it be garbage-collected without ``close()``
    (:meth:`_release_when_collected`), and ``close()`` calls :meth:`_closed_explicitly`.
    """

    _finalizer: weakref.finalize[Any, Any] | None = None

    def close(self) -> None:
        raise NotImplementedError

    def _release_when_collected(self, release: Callable[..., object], *args: object) -> None:
        """Run ``release(*args)`` once this object is garbage-collected unless it was closed.

        Neither ``release`` nor ``args`` may refer to this object (it would never be collected).
        Nothing runs at interpreter exit: a process that ends frees everything anyway.
        """
        name = type(self).__name__
        self._finalizer = weakref.finalize(self, _collected, name, release, *args)
        self._finalizer.atexit = False

    def _closed_explicitly(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:
            logger.error("closing %s after an error: %s", type(self).__name__, close_error)
