"""A store process that could not start, told to the ranks that wait for it.

The initial rank 0 starts the store process (:class:`trainguard.coord.store.StoreProcess`);
the other ranks only try to connect to it. When it cannot start (its port is taken, the torch
in use cannot host it) the other ranks would wait out their connect timeout and then report a
store they "could not connect to", or hang in torch's client when something else listens on
the port. So rank 0 leaves the store process's own error in a notice file, in this user's
private directory (:func:`trainguard._private.private_dir`), named after the job, the call and
the coordination address; the other ranks look at it between their connect attempts and while
they wait for the job secret, and fail at once with that error.

Ranks on other machines cannot see the file: they still wait for their connect timeout. A
notice counts only when it was written after this process imported trainguard (less
:data:`_SLACK`): one left by an earlier attempt of the same job is not taken for this one's,
and rank 0 removes it before it starts its store process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path

from trainguard import _private
from trainguard.errors import ConfigError

__all__ = ["StartNotice"]

logger = logging.getLogger(__name__)

_STARTED = time.time()  # when this process imported trainguard's coordination
_SLACK = 10.0  # seconds: rank 0 may fail that long before a slow rank imports trainguard
_MAX = 64 * 1024  # bytes read from a notice


class StartNotice:
    """The notice of one wrapped call's store process (see the module docstring)."""

    def __init__(self, job: str, call: int, host: str, port: int) -> None:
        digest = hashlib.sha256(f"{job}\0{call}\0{host}\0{port}".encode()).hexdigest()
        self.name = f"storefail-{digest[:32]}"

    @property
    def path(self) -> Path:
        """The notice's file (raises :class:`ConfigError` for an unusable private directory)."""
        return _private.private_dir() / self.name

    def clear(self) -> None:
        """Remove an earlier attempt's notice (rank 0, before it starts the store process)."""
        with contextlib.suppress(OSError, ConfigError):
            os.unlink(self.path)

    def publish(self, error: str) -> None:
        """Leave ``error`` for the other ranks (best effort: a failure is logged)."""
        tmp = None
        try:
            path = self.path
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(error)
            os.replace(tmp, path)
        except (OSError, ConfigError) as exc:
            logger.warning("could not tell the other ranks that the store failed: %s", exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def read(self) -> str | None:
        """The error rank 0 left for this attempt, or None."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except (OSError, ConfigError):
            return None
        with os.fdopen(fd) as f:
            if os.fstat(f.fileno()).st_mtime < _STARTED - _SLACK:
                return None  # an earlier attempt's
            return f.read(_MAX)

    def failure(self) -> str | None:
        """:meth:`read` worded for the rank that finds it."""
        error = self.read()
        return None if error is None else f"rank 0 could not start the coordination store: {error}"
