"""The context-manager behaviour both checkpointers share: ``with`` closes, never masking."""

from __future__ import annotations

import logging
from typing import TypeVar

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Base of an object with ``close()``: leaving a ``with`` block closes it.

    When the block raised, an error from ``close()`` is logged, not raised, so that it never
    replaces the exception already propagating.
    """

    def close(self) -> None:
        raise NotImplementedError

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
