"""Addresses as trainguard reads them: ``host:port`` strings and whether a host is this machine.

The ground floor (it imports only :mod:`trainguard.errors`), so that :mod:`trainguard._env` can
check ``TRAINGUARD_STORE_ADDR`` and :mod:`trainguard.coord` can connect without either reaching
up to the other. :func:`trainguard.coord.store.parse_addr` is this module's function.
"""

from __future__ import annotations

import socket

from trainguard.errors import ConfigError

__all__ = ["is_local_address", "parse_addr"]


def parse_addr(value: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; a host and a port in 1..65535 are required.

    Raises :class:`ConfigError` (a ``ValueError``) naming what is wrong.
    """
    host, sep, port = value.rpartition(":")
    host = host.strip("[]").strip()
    why = None
    if not sep:
        why = "no ':'"
    elif not host:
        why = "no host"
    elif not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        why = f"port {port!r} is not a number in 1..65535"
    if why is not None:
        raise ConfigError(f"{value!r} is not 'host:port' ({why}); write it like '10.0.0.1:29500'")
    return host, int(port)


def is_local_address(host: str) -> bool:
    """True when ``host`` names an address of this machine (it can be bound here)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False
