"""coord.store.probe: up and refused (a cut-off host, "silent", is met in tests/cluster)."""

from __future__ import annotations

import socket

from trainguard.coord.store import probe


def test_a_probe_tells_a_server_from_a_closed_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe("127.0.0.1", port) == "up"
    assert probe("127.0.0.1", port) == "refused"  # the host answers: nothing listens
