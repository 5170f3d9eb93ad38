"""Abort of torch.distributed so that no rank stays blocked in a collective.

- NCCL (when a process group has a CUDA backend): the communicators are aborted with
  ``_abort_process_group``, which also forgets every group.
- gloo: ``abort()``/``shutdown()`` in torch 2.13 do not release a collective already waiting on
  a peer. We shut down the group's own connected TCP sockets, which makes the pending
  collective raise at once; then the groups are destroyed. The shutdown has two steps (see
  :func:`release_group_sockets`): reading first, so that gloo's event loop sees end-of-file and
  fails the pair, then writing, for what is left.

The group's sockets are identified precisely: while the wrapper runs, the constructor of every
process group (``torch.distributed.distributed_c10d._new_process_group_helper``, called by
``init_process_group`` and ``new_group``) is wrapped so that the socket inodes of the process
before and after it are compared, and its set-up time is recorded as a ``pg_setup`` event
(``duration``: from the start of ``init_process_group``'s rendezvous, or of the constructor,
to its end; ``store_s``: the rendezvous's part; ``group_size``). The store's client connects
before the constructor runs and the user's sockets are not made inside it, so neither is ever
touched. The group's listening
sockets are never shut down (gloo's listener thread aborts the process on an accept error),
but their ports are noted: a peer's connection that the listener accepts after the
constructor returned (seen with 8 ranks) has that local port and is shut down too; without
it, a collective could stay blocked on that connection. Before a shutdown, the descriptor is
checked to still name the recorded inode (descriptor numbers are reused).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from trainguard import _torchcompat, events
from trainguard.coord import _sockets
from trainguard.restart import _setup

__all__ = ["GroupSockets", "abort_distributed", "destroy_groups", "shutdown_connections_to"]

logger = logging.getLogger(__name__)

_destroy_lock = threading.Lock()
_rendezvous_at = threading.local()  # .start: when this thread's last rendezvous began


def note_rendezvous(start: float | None) -> None:
    """Record (or clear, with None) when this thread's ``init_process_group`` began to make its
    store (``time.monotonic()``); the next ``pg_setup`` event counts from there."""
    _rendezvous_at.start = start


def rendezvous_started() -> float | None:
    """The start :func:`note_rendezvous` recorded in this thread (handed out once), or None."""
    start = getattr(_rendezvous_at, "start", None)
    _rendezvous_at.start = None
    return start


#: torch modules that read the default group at import time and keep it for good:
#: ``torch.distributed.nn.functional`` binds ``group.WORLD`` as default arguments (imported by
#: ``torch._dynamo``, i.e. by the first ``optimizer.step()``). Imported in a round, it pins
#: that round's default group (store connection, gloo transport) for the life of the process.
_PINNING_IMPORTS = ("torch.distributed.nn.functional",)


def _import_before_groups() -> None:
    """Import :data:`_PINNING_IMPORTS` while no default group exists (then they bind None)."""
    import importlib
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        return
    for name in _PINNING_IMPORTS:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a torch without it: nothing to pin
                logger.debug("could not import %s: %s", name, exc)


class GroupSockets:
    """Record the connected TCP sockets that process group constructors open (process-wide).

    :meth:`install` / :meth:`uninstall` nest (a count); :meth:`take` returns and forgets the
    sockets recorded so far as ``inode -> fd``. Recording happens in the thread that builds
    the group, off the restart path; listening sockets are left out then (``SO_ACCEPTCONN``).
    """

    _lock = threading.Lock()
    _users = 0
    _original: Any = None
    _sockets: dict[int, int] = {}  # noqa: RUF012 - process-wide on purpose
    _listen_ports: set[int] = set()  # noqa: RUF012 - the groups' own listening ports
    _excluded: set[int] = set()  # noqa: RUF012 - connections known to be no group's
    #: servers whose connections are no group's: (host, port) -> (its addresses, port)
    _peers: dict[tuple[str, int], tuple[set[str], int]] = {}  # noqa: RUF012

    @classmethod
    def install(cls, *, connect_bound: float | None = None) -> None:
        """``connect_bound``: bound the connect phase of the constructors to it (seconds,
        :mod:`trainguard.restart._setup`) until the matching :meth:`uninstall`."""
        import torch.distributed.distributed_c10d as c10d

        _import_before_groups()
        _setup.SetupBound.push(connect_bound)
        with cls._lock:
            cls._users += 1
            if cls._users > 1:
                return
            original = c10d._new_process_group_helper
            cls._original = original

            def tracked(*args: Any, **kwargs: Any) -> Any:
                start = time.monotonic()
                began = rendezvous_started() or start
                before = set(_sockets.socket_fds())
                try:
                    group = _setup.build(original, args, kwargs)  # its connects bounded
                    _emit_setup(began, start, args)
                    return group
                finally:
                    new: dict[int, int] = {}
                    ports: set[int] = set()
                    for inode, fd in _sockets.socket_fds().items():
                        kind = None if inode in before else _stream(fd, inode)
                        if kind is not None and kind[0]:
                            ports.add(kind[1])
                        elif kind is not None:
                            new[inode] = fd
                    with cls._lock:
                        cls._sockets.update(new)
                        cls._listen_ports |= ports

            tracked.__wrapped__ = original  # type: ignore[attr-defined]
            c10d._new_process_group_helper = tracked

    @classmethod
    def uninstall(cls) -> None:
        import torch.distributed.distributed_c10d as c10d

        _setup.SetupBound.pop()
        with cls._lock:
            cls._users -= 1
            if cls._users > 0:
                return
            if cls._original is not None:
                c10d._new_process_group_helper = cls._original
            cls._original = None
            cls._sockets = {}
            cls._listen_ports = set()
            cls._excluded = set()
            cls._peers = {}

    @classmethod
    def exclude_peer(cls, host: str, port: int) -> None:
        """Never take connections to ``host:port``: the server of a store that another thread
        of this process connects to while a group may be being built (a store client made
        ahead of time). Given before that connect starts, it covers the connect's every
        attempt however its timing falls against a group's construction and an abort (an
        exclusion made once the connect had returned left a moment in which an abort shut the
        new client down). The name is resolved here, off the abort's path. Call
        :meth:`settle_peer` once the connect has returned."""
        addresses = _addresses(host, port)
        with cls._lock:
            cls._peers[(host, port)] = (addresses, port)

    @classmethod
    def settle_peer(cls, host: str, port: int) -> None:
        """The connect to ``host:port`` returned: its connections are excluded one by one
        from now on, and the server no longer as a whole (which costs :meth:`take` a look at
        every recorded socket: a group of N ranks has N - 1 of them)."""
        inodes = set(connections_to(host, port))
        with cls._lock:
            cls._excluded |= inodes
            for inode in inodes:
                cls._sockets.pop(inode, None)
            cls._peers.pop((host, port), None)

    @classmethod
    def take(cls) -> dict[int, int]:
        """The recorded connections, plus connections accepted later by a group's listener,
        less those to an excluded server (:meth:`exclude_peer`)."""
        with cls._lock:
            found, cls._sockets = cls._sockets, {}
            ports, cls._listen_ports = cls._listen_ports, set()
            excluded = set(cls._excluded)
            peers = list(cls._peers.values())
        if ports:
            # A peer's connection may be accepted after the constructor returned: it is ours
            # if its local port is one of the groups' listening ports.
            for inode, fd in _sockets.socket_fds().items():
                if inode in found or inode in excluded:
                    continue
                kind = _stream(fd, inode)
                if kind is not None and not kind[0] and kind[1] in ports:
                    found[inode] = fd
        return {
            inode: fd
            for inode, fd in found.items()
            if inode not in excluded and not (peers and _to_any(fd, inode, peers))
        }


def _to_any(fd: int, inode: int, peers: list[tuple[set[str], int]]) -> bool:
    """Whether socket ``fd`` (``inode``) is connected to one of ``peers``."""
    peer = _peer(fd, inode)
    return peer is not None and any(peer[1] == port and peer[0] in hosts for hosts, port in peers)


def _emit_setup(began: float, start: float, args: tuple[Any, ...]) -> None:
    """The ``pg_setup`` event of a group just built: from its rendezvous (``began``, when
    ``init_process_group`` made its store) or its constructor's start to now."""
    events.emit(
        "pg_setup",
        duration=time.monotonic() - began,
        store_s=start - began,
        group_size=args[0] if args and isinstance(args[0], int) else None,
    )


def _stream(fd: int, inode: int) -> tuple[bool, int] | None:
    """``(listening, local port)`` of a TCP socket (IPv4 or IPv6), None for anything else.

    Asks the socket itself (a few system calls): reading ``/proc/net/tcp`` instead lists every
    socket of the machine, tens of milliseconds on a busy host, on the restart's critical path.
    """
    dup = _sockets.fd_of_inode(fd, inode)
    if dup is None:
        return None
    sock = socket.socket(fileno=dup)
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.type != socket.SOCK_STREAM:
            return None
        listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        return listening, int(sock.getsockname()[1])
    except (OSError, IndexError, TypeError, ValueError):
        return None
    finally:
        sock.close()


#: how long :func:`release_group_sockets` waits for gloo to close the pairs it shut for reading.
_PAIR_CLOSE_WAIT_S = 0.05


def release_group_sockets(recorded: dict[int, int]) -> int:
    """Release a collective blocked on these group sockets; returns how many were shut down.

    First ``shutdown(SHUT_RD)``: gloo's event loop reads end-of-file, marks the pair failed
    (every operation pending on it raises, every later one raises at once) and closes it. Only
    then ``SHUT_RDWR`` on what is still open (up to :data:`_PAIR_CLOSE_WAIT_S` later). A write
    shut down first would make a send that gloo starts in between fail with ``EPIPE``: gloo then
    queues that send and, when the pair fails a moment later, never wakes its waiter (the
    collective blocks until the group's timeout; seen about once in 100 aborted rounds here).
    """
    count = shutdown_sockets(recorded, socket.SHUT_RD)
    if not count:
        return 0
    deadline = time.monotonic() + _PAIR_CLOSE_WAIT_S
    left = recorded
    while True:
        fds = _sockets.socket_fds()
        left = {inode: fd for inode, fd in left.items() if inode in fds}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.0005)
    if left:
        shutdown_sockets(left)
    return count


def shutdown_sockets(recorded: dict[int, int], how: int = socket.SHUT_RDWR) -> int:
    """``shutdown(how)`` every recorded socket still open; returns how many.

    Each descriptor is checked to still name its inode; one that moved is looked up again.
    """
    count = 0
    fds: dict[int, int] | None = None
    for inode, fd in recorded.items():
        dup = _sockets.fd_of_inode(fd, inode)
        if dup is None:
            if fds is None:
                fds = _sockets.socket_fds()
            if inode not in fds:
                continue  # closed already (its peer went away first)
            dup = _sockets.fd_of_inode(fds[inode], inode)
            if dup is None:
                continue
        sock = socket.socket(fileno=dup)
        try:
            sock.shutdown(how)
            count += 1
        except OSError:
            pass  # no longer connected
        finally:
            sock.close()  # closes our duplicate only
    return count


def shutdown_connections_to(host: str, port: int) -> int:
    """``shutdown(SHUT_RDWR)`` this process's TCP connections to ``host:port``; how many.

    Used on the round's store when a round is aborted: a wait on that store (a gather of the
    checkpointers, the rendezvous inside a process group's constructor) blocks in C++, where
    the restart interrupt cannot land; with its connection shut down it raises at once.
    """
    return shutdown_sockets(connections_to(host, port))


def connections_to(host: str, port: int) -> dict[int, int]:
    """This process's TCP connections to ``host:port`` as ``inode -> fd``. The peer is compared
    by address (every address ``host`` resolves to) and port."""
    addresses = _addresses(host, port)
    found: dict[int, int] = {}
    for inode, fd in _sockets.socket_fds().items():
        peer = _peer(fd, inode)
        if peer is not None and peer[1] == port and peer[0] in addresses:
            found[inode] = fd
    return found


def _addresses(host: str, port: int) -> set[str]:
    """Every address ``host`` resolves to (none when it does not)."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        logger.debug("cannot resolve %s:%d: %s", host, port, exc)
        return set()


def _peer(fd: int, inode: int) -> tuple[str, int] | None:
    """The address and port that stream socket ``fd`` (``inode``) is connected to; None for
    another kind of socket or one not connected."""
    dup = _sockets.fd_of_inode(fd, inode)
    if dup is None:
        return None
    sock = socket.socket(fileno=dup)
    try:
        if sock.type != socket.SOCK_STREAM:
            return None
        peer = sock.getpeername()
        return str(peer[0]).removeprefix("::ffff:"), int(peer[1])  # an IPv4 peer on IPv6
    except (OSError, IndexError, TypeError, ValueError):
        return None  # not connected, or not an IP socket
    finally:
        sock.close()


def destroy_groups() -> bool:
    """Destroy every process group (aborting NCCL communicators first); True if any existed.

    Also resets torch's group counter where a failed constructor left it raised."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    with _destroy_lock:
        if not dist.is_initialized():
            world = dist.distributed_c10d._world
            if not world.pg_map:
                # An init_process_group that failed (or was interrupted) after naming its group
                # leaves the group counter raised: this rank's next default group would get
                # another store prefix than its peers' and wait for them forever.
                world.group_count = 0
            return False
        try:
            if _torchcompat.has_cuda_backend(dist.distributed_c10d._get_default_group()):
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # a group half torn down by the user: forget it anyway
            logger.debug("destroying process groups failed: %s", exc)
            with contextlib.suppress(Exception):
                dist.distributed_c10d._world.pg_map.clear()
                dist.distributed_c10d._update_default_pg(None)
        return True


def abort_distributed() -> dict[str, Any]:
    """Release any collective pending in this process, then destroy the process groups.

    Safe to call from any thread and more than once. Returns what was done (for events).
    """
    start = time.monotonic()
    shut = release_group_sockets(GroupSockets.take())
    mid = time.monotonic()
    destroyed = destroy_groups()
    return {
        "sockets": shut,
        "destroyed": destroyed,
        "shutdown_s": mid - start,
        "destroy_s": time.monotonic() - mid,
    }
