"""This process's TCP sockets, read from ``/proc`` (Linux): inode, fd, endpoints, state."""

from __future__ import annotations

import contextlib
import dataclasses
import os

LISTEN = "0A"
ESTABLISHED = "01"


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    inode: int
    local_port: int
    remote_port: int
    state: str  # two hex digits as in /proc/net/tcp ("01" established, "0A" listen)


def socket_fds() -> dict[int, int]:
    """socket inode -> file descriptor, for every socket this process holds open."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def tcp_sockets(inodes: set[int] | None = None) -> list[TcpSocket]:
    """TCP sockets (IPv4 and IPv6) of this network namespace, or only those in ``inodes``."""
    found: list[TcpSocket] = []
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            inode = int(parts[9])
            if inodes is not None and inode not in inodes:
                continue
            found.append(
                TcpSocket(
                    inode=inode,
                    local_port=int(parts[1].rsplit(":", 1)[1], 16),
                    remote_port=int(parts[2].rsplit(":", 1)[1], 16),
                    state=parts[3],
                )
            )
    return found


def fd_of_inode(fd: int, inode: int) -> int | None:
    """A duplicate of ``fd`` if it still refers to socket ``inode`` (the caller closes it).

    File descriptor numbers are reused at once after a close, so a number read from /proc a
    moment ago may now name another socket; the duplicate is checked against the inode.
    """
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:
            return dup
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.close(dup)
    return None
