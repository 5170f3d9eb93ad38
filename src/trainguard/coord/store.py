"""Connecting to the coordination store, and the store process that hosts it.

By default the initial rank 0 starts :class:`StoreProcess` (a separate interpreter, see
:mod:`trainguard.coord._server`) that hosts the coordination TCPStore (libuv backend) and the
per-round stores, so that no training process's crash takes the store down. Every rank,
rank 0 included, talks to it as a client through :func:`connect`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from trainguard import _subproc
from trainguard._addr import parse_addr
from trainguard.coord import _wire
from trainguard.errors import CoordinationError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["StoreLike", "StoreProcess", "as_store", "connect", "parse_addr", "probe"]

logger = logging.getLogger(__name__)

_ATTEMPT_S = 1.0  # one connect attempt while a reason to give up may come (see connect)


@runtime_checkable
class StoreLike(Protocol):
    """What the coordination code asks of a store client: torch's ``TCPStore`` and
    ``PrefixStore`` (a rank), or :class:`._wire.WireStore` (a helper process that never imports
    torch), whichever :func:`connect` made.

    The operations are TCPStore's, with its semantics: ``get``, ``multi_get`` and ``wait``
    wait for their keys (up to the store timeout, or ``timeout``); ``compare_set`` sets
    ``key`` to ``desired`` when its value is ``expected`` (or it is unset and ``expected`` is
    empty) and returns the value the key then holds; ``append`` adds bytes at the end of a
    value (creating it); ``clone`` opens a new connection to the same server (for a thread of
    its own). A client serializes its calls: a ``wait`` holds it until it returns.

    Values are ``str`` or ``bytes``: both clients take either (torch's type stubs say ``str``
    and lack ``append``, so a torch store becomes a ``StoreLike`` through one ``cast`` where it
    enters, as in :func:`connect`). Arguments are positional: the two clients name them
    differently.
    """

    def set(self, key: str, value: str | bytes, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, amount: int, /) -> int: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes, /) -> bytes: ...
    def check(self, keys: list[str], /) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta = ..., /) -> None: ...
    def multi_get(self, keys: list[str], /) -> list[bytes]: ...
    def delete_key(self, key: str, /) -> bool: ...
    def append(self, key: str, value: str | bytes, /) -> None: ...
    def clone(self) -> StoreLike: ...


def as_store(store: Store) -> StoreLike:
    """``store`` (a torch ``Store``: a TCPStore, a PrefixStore, the rendezvous store) typed as
    the :class:`StoreLike` it is at run time; the same object (see :class:`StoreLike`)."""
    return cast(StoreLike, store)


def probe(host: str, port: int, timeout: float = 1.0) -> str:
    """What a TCP connect to ``host:port`` meets within ``timeout`` seconds: ``"up"`` (a server
    accepts it), ``"refused"`` (the host answers that nothing listens there: a server that
    ended) or ``"silent"`` (no answer: the host is lost or cut off, or the name does not resolve).
    Nothing is sent; the connection is closed at once."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "up"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def connect(
    host: str, port: int, *, timeout: float, gave_up: Callable[[], str | None] | None = None
) -> StoreLike:
    """A TCPStore client of ``host:port``; retries until the server is up or ``timeout``.

    torch's client, or in a helper process that called :func:`._wire.activate` the pure-Python
    one (the same operations, no torch import). ``gave_up``: says why the server will never
    come (a :class:`._startfail.StartNotice`), or None; asked between connect attempts, which
    are then made with the pure-Python client (torch's hangs past its timeout when something
    that is not a store listens on the port) until the server answers."""
    if gave_up is not None:
        timeout = _await_server(host, port, timeout, gave_up)
    if _wire.active():
        return _wire.connect(host, port, timeout=timeout)
    import torch.distributed as dist

    try:
        client = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True
        )
        return as_store(client)
    except Exception as exc:
        raise CoordinationError(
            f"could not connect to the coordination store at {host}:{port} within {timeout:g} s "
            f"({exc}); check MASTER_ADDR/MASTER_PORT or TRAINGUARD_STORE_ADDR"
        ) from exc


def _await_server(host: str, port: int, timeout: float, gave_up: Callable[[], str | None]) -> float:
    """Wait until a TCPStore server answers at ``host:port``, asking ``gave_up`` between
    attempts; the time left of ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        why = gave_up()
        if why is not None:
            raise CoordinationError(why)
        left = deadline - time.monotonic()
        try:
            _wire.connect(host, port, timeout=max(0.01, min(_ATTEMPT_S, left))).close()
            return max(0.01, deadline - time.monotonic())
        except CoordinationError as exc:
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"could not connect to the coordination store at {host}:{port} within "
                    f"{timeout:g} s ({exc})"
                ) from exc


class StoreProcess:
    """Handle of the store process started by the initial rank 0.

    Args:
        job, call, secret: the keyspace (see :class:`trainguard.coord.keys.Keyspace`); the
            secret is sent on the process's stdin, never on its command line.
        coord_host, coord_port: where the coordination store listens (``host_coord=True``:
            this process hosts it there, bound to ``coord_host``'s interface only) or is to be
            found (``host_coord=False``).
        advertise_host: host name or address that other ranks use to reach this machine.
        bind_host: the address the round stores listen on (default ``advertise_host``; ``""``
            every interface), see :func:`trainguard.coord._bind.bind_host`.
        world_size: initial world size (for deleting keys from an external store).
        timeout: store operation timeout in seconds.
        orphan_grace: seconds without clients, once the parent is gone, before it exits;
            once this process's parent (its owner) is gone too, it exits whatever
            connections are left.
        new_session: start it in a session of its own, so that a kill of this process's group
            does not reach it (under ``trainguard launch`` the agent kills a dead worker's
            group before it respawns the slot; the store serves the others meanwhile).
        standby: a standby on a second host (see :mod:`trainguard.coord._server`): it hosts
            round stores only, published under :meth:`~trainguard.coord.keys.Keyspace.pg_standby`.
    """

    def __init__(
        self,
        *,
        job: str,
        call: int,
        secret: str = "",
        coord_host: str,
        coord_port: int,
        host_coord: bool,
        advertise_host: str,
        bind_host: str | None = None,
        world_size: int,
        timeout: float,
        orphan_grace: float = 10.0,
        new_session: bool = False,
        standby: bool = False,
    ) -> None:
        if standby and host_coord:
            raise ValueError("a standby store process never hosts the coordination store")
        self.config = {
            "standby": standby,
            "job": job,
            "call": call,
            "secret": secret,
            "coord_host": coord_host,
            "coord_port": coord_port,
            "host_coord": host_coord,
            "advertise_host": advertise_host,
            "bind_host": advertise_host if bind_host is None else bind_host,
            "world_size": world_size,
            "timeout": timeout,
            "orphan_grace": orphan_grace,
            "parent": os.getpid(),
            "owner": os.getppid(),
        }
        self.timeout = timeout
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def start(self) -> StoreProcess:
        """Start the process and wait for its handshake (it binds its ports first)."""
        self.proc = _subproc.start_module(
            "trainguard.coord._server",
            self.config,
            keep_stdin=False,
            new_session=self.new_session,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.proc.stdout.close()
        reply: dict[str, Any]
        try:
            reply = json.loads(line) if line else {"ok": False, "error": "exited at start"}
        except ValueError:
            reply = {"ok": False, "error": f"unreadable handshake {line!r}"}
        if not reply.get("ok"):
            self.kill()
            raise CoordinationError(
                f"the store process could not start: {reply.get('error')}; is port "
                f"{self.config['coord_port']} free (MASTER_PORT)?"
            )
        self.port = int(reply["port"])
        return self

    def join(self, timeout: float) -> bool:
        """Wait for the process to exit on its own (after the job's ``exit`` key)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` s for a clean exit, then kill; leaves no zombie."""
        start = time.monotonic()
        if not self.join(timeout):
            logger.warning("store process did not exit within %.1f s; killing it", timeout)
            self.kill()
        logger.debug("store process ended after %.3f s", time.monotonic() - start)
