"""The job secret: an unguessable part of every key name, and how the ranks learn it.

A TCPStore has no authentication and cannot list its keys, so a key name that holds a secret
cannot be read or forged by someone who can reach the store but does not know the secret.
Where it comes from (decided by :func:`source`, the same on every rank):

- ``env``: ``TRAINGUARD_JOB_SECRET`` is set (the same value on every node, by the user or the
  launcher). Nothing is handed over; the secret never enters the store.
- ``file``: otherwise, when ``MASTER_ADDR`` is a loopback address (every rank on this
  machine): the initial rank 0 creates a random secret, writes it to a file in this user's
  private directory (:func:`trainguard._private.private_dir`, mode 0600) named after a digest
  of it, and puts only the digest in the store (:attr:`Keyspace.handover`); the others read
  the digest and then the file. Other users of the machine never see the secret.
- ``store``: otherwise (ranks on several hosts, no variable), and only when
  ``TRAINGUARD_INSECURE=1`` says so: rank 0 creates it and puts it in the store itself, so
  anyone who can reach the store and knows this protocol can read it: it only keeps out blind
  writes. Rank 0 logs a warning that says to set the variable. Without ``TRAINGUARD_INSECURE``
  such a job refuses to start (:class:`~trainguard.errors.ConfigError` naming the fix).

The secret travels to the library's helper processes on their stdin, never on a command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from trainguard import _env, _private
from trainguard.coord import barrier
from trainguard.coord._bind import is_loopback
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike
from trainguard.errors import ConfigError, CoordinationError

__all__ = ["Handover", "current", "source"]

logger = logging.getLogger(__name__)

_SLICE = 0.25  # seconds between two looks at whether the job ended (a late process's wait)
_GAVE_UP_SLICE = 1.0  # seconds between two looks at whether rank 0's store process failed

Source = Literal["env", "file", "store"]
_SECRET = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_active: list[str] = []  # secrets of the wrapped calls running in this process, innermost last


def source(master_addr: str) -> Source:
    """How this job's ranks learn the secret (see the module docstring)."""
    if _env.settings().job_secret is not None:
        return "env"
    return "file" if is_loopback(master_addr) else "store"


def current() -> str:
    """The secret for keys made outside a keyspace (checkpointers): the variable's, else that
    of the wrapped call running in this process, else ``""``."""
    env = _env.settings().job_secret
    if env is not None:
        return env
    return _active[-1] if _active else ""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Handover:
    """One wrapped call's secret on one rank: :meth:`create` (initial rank 0, before the
    store is up), :meth:`publish` (rank 0, once connected), :meth:`receive` (the others), and
    :meth:`close` at the end of the call (rank 0 removes its file)."""

    def __init__(self, keys: Keyspace, how: Source) -> None:
        if how == "store" and not _env.settings().insecure:
            raise ConfigError(
                "this job runs on several hosts (MASTER_ADDR is not a loopback address) and "
                "TRAINGUARD_JOB_SECRET is not set: without it the job secret would travel "
                "through the store, where any host that reaches it can read it. Set "
                "TRAINGUARD_JOB_SECRET to the same random value on every node (e.g. the output "
                "of `openssl rand -hex 16`; `trainguard launch` hands its own to its workers), "
                "or set TRAINGUARD_INSECURE=1 to run without that protection"
            )
        self.keys = keys
        self.how = how
        self.secret = _env.settings().job_secret if how == "env" else None
        self.file: Path | None = None

    def create(self) -> str:
        if self.secret is None:
            self.secret = secrets.token_hex(16)
        if self.how == "store":
            logger.warning(
                "TRAINGUARD_JOB_SECRET is not set and MASTER_ADDR is not a loopback address: "
                "the job secret is handed to the other ranks through the store, where any host "
                "that can reach it can read it; set TRAINGUARD_JOB_SECRET to the same random "
                "value on every node (e.g. the output of `openssl rand -hex 16`)"
            )
        elif self.how == "file":
            self.file = _private.private_dir() / f"secret-{_digest(self.secret)}"
            fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.secret)
        _active.append(self.secret)
        return self.secret

    def publish(self, store: StoreLike) -> None:
        assert self.secret is not None
        if self.how != "env":
            value = self.secret if self.how == "store" else _digest(self.secret)
            store.set(self.keys.handover, value)

    def receive(
        self,
        store: StoreLike,
        timeout: float,
        *,
        ended: str | None = None,
        gave_up: Callable[[], str | None] | None = None,
    ) -> str | None:
        """The secret rank 0 created (waits up to ``timeout`` s for it to be published).

        ``ended``: a key that says the job is over (:attr:`Keyspace.ended`); when it is set
        before the secret, returns None (a process that came too late to join). ``gave_up``:
        says why rank 0 will never publish it (its store process failed while this rank
        reached another store on that port), or None; asked while waiting."""
        if self.how != "env":
            raw = self._wait(store, timeout, ended, gave_up)
            if raw is None:
                return None
            self.secret = raw if self.how == "store" else self._read_file(raw)
            if not _SECRET.fullmatch(self.secret):
                raise CoordinationError(
                    f"the job secret handed over in the store is malformed ({self.how}); another "
                    "job may share this store: set TRAINGUARD_JOB_ID or TRAINGUARD_JOB_SECRET"
                )
        assert self.secret is not None
        _active.append(self.secret)
        return self.secret

    def _read_file(self, digest: str) -> str:
        if not _DIGEST.fullmatch(digest):
            return ""
        path = _private.private_dir() / f"secret-{digest}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                secret = f.read(65)
        except OSError as exc:
            raise CoordinationError(
                f"could not read the job secret that rank 0 left in {path} ({exc}); with "
                "MASTER_ADDR a loopback address every rank must run on rank 0's machine as the "
                "same user; or set TRAINGUARD_JOB_SECRET"
            ) from exc
        return secret if _digest(secret) == digest else ""

    def _wait(
        self,
        store: StoreLike,
        timeout: float,
        ended: str | None,
        gave_up: Callable[[], str | None] | None,
    ) -> str | None:
        what = "the job secret from rank 0"
        if ended is None and gave_up is None:
            return barrier.wait_key(store, self.keys.handover, timeout, what=what).decode(
                errors="replace"
            )
        deadline = time.monotonic() + timeout
        look = _SLICE if ended is not None else _GAVE_UP_SLICE
        while not barrier.wait_all(store, [self.keys.handover], look, what=what):
            why = gave_up() if gave_up is not None else None
            if why is not None:
                raise CoordinationError(why)
            if ended is not None and store.check([ended]):
                return None
            if time.monotonic() >= deadline:
                barrier.wait_key(store, self.keys.handover, 0.001, what=what)  # raises
        return bytes(store.get(self.keys.handover)).decode(errors="replace")

    def close(self) -> None:
        if self.secret in _active:
            _active.remove(self.secret)
        if self.file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file)
            self.file = None
