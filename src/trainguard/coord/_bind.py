"""Listening sockets for the stores the library hosts, bound to one interface only.

A ``TCPStore`` server listens on every interface (``::``) whatever host it is given. The
library creates the listening socket itself, bound to the address of the host the ranks use
(``MASTER_ADDR``: the loopback interface when that is a loopback address), and hands it to
``TCPStore(master_listen_fd=...)``, which owns it from then on (through
:func:`trainguard._torchcompat.host_store`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket

from trainguard.errors import CoordinationError

__all__ = ["bind_host", "is_loopback", "listen", "port_of"]

logger = logging.getLogger(__name__)


def _addresses(host: str) -> list[tuple[int, str]]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in infos]


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    found = _addresses(host)
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for _, a in found)


def bind_host(advertise: str, *, local: bool) -> str:
    """Where a store advertised as ``advertise`` listens: ``advertise`` itself when it is the
    ranks' ``MASTER_ADDR`` on this machine (``local``); else (a host name) the first
    non-loopback address of this machine it resolves to, or ``""`` (every interface, with a
    warning that says how to avoid it) when it resolves to none (a name that maps to
    ``127.0.1.1`` here but to the real address elsewhere)."""
    if local:
        return advertise
    for _, address in _addresses(advertise):
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return address
    logger.warning(
        "%s resolves to no non-loopback address of this machine: the stores trainguard hosts "
        "here listen on every interface; to have them listen on one, set MASTER_ADDR to an "
        "address of this machine (rank 0's; under `trainguard launch`, its node's "
        "--local-addr) or make %s resolve to one (e.g. in /etc/hosts)",
        advertise,
        advertise,
    )
    return ""


def _bound(family: int, address: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def listen(host: str, port: int) -> int:
    """File descriptor of a socket listening on ``host:port`` (``port`` 0: a free one).

    ``host`` ``""`` listens on every interface. A host with no address on this machine (a
    load-balanced name) falls back to every interface, with a warning; a port in use raises
    :class:`CoordinationError`. The caller passes the descriptor to ``TCPStore``, which
    closes it.
    """
    wanted: list[tuple[int, str]] = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    if host:
        wanted = _addresses(host)
    failure: OSError | None = None
    for family, address in wanted:
        try:
            return _bound(family, address, port).detach()
        except OSError as exc:
            failure = exc
            if exc.errno == errno.EADDRINUSE:
                break
    if failure is not None and failure.errno == errno.EADDRNOTAVAIL and host:
        logger.warning(
            "%s is not an address of this machine; the store listens on every interface "
            "(set MASTER_ADDR to an address of this machine to listen on one only)",
            host,
        )
        return listen("", port)
    raise CoordinationError(
        f"could not listen on {host or '*'}:{port} ({failure or 'the host does not resolve'}); "
        "check MASTER_ADDR and that MASTER_PORT is free"
    )


def port_of(fd: int) -> int:
    """The port a listening descriptor from :func:`listen` is bound to."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        port: int = sock.getsockname()[1]
    return port
