"""The emulated hosts themselves: names, addresses, partitions, kills, teardown."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster, leftovers

pytestmark = pytest.mark.timeout(60)

SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen()
while True:
    c, peer = s.accept()
    c.sendall(socket.gethostname().encode() + b" " + peer[0].encode())
    c.close()
"""

ASK = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    print(c.recv(100).decode())
except OSError as e:
    print("unreachable", type(e).__name__)
"""


def _ask(c: Cluster, host: int, target: str, timeout: float = 2.0) -> str:
    return c.run(c.hosts[host], [sys.executable, "-c", ASK, target, str(timeout)]).strip()


def test_hosts_have_their_own_names_and_addresses_and_reach_each_other_by_name(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(3)
    assert [c.run(h, ["hostname"]).strip() for h in c.hosts] == ["h1", "h2", "h3"]
    c.start(c.hosts[1], [sys.executable, "-c", SERVE], log=tmp_path / "serve.log")
    deadline = time.monotonic() + 20
    while (answer := _ask(c, 0, "h2")).startswith("unreachable") and time.monotonic() < deadline:
        time.sleep(0.1)
    # h1 reached h2 by name, over the bridge, from its own address
    assert answer == f"h2 {c.hosts[0].addr}"
    assert c.hosts[0].addr.startswith(("198.18.", "198.19."))
    assert "h3" in c.run(c.hosts[2], ["cat", "/etc/hosts"])
    assert all(h.local.is_dir() for h in c.hosts)


def test_a_cut_host_is_unreachable_until_healed_and_a_killed_host_runs_nothing(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(2)
    server = c.start(c.hosts[1], [sys.executable, "-c", SERVE], log=tmp_path / "serve.log")
    deadline = time.monotonic() + 20
    while _ask(c, 0, "h2").startswith("unreachable") and time.monotonic() < deadline:
        time.sleep(0.1)
    c.cut(c.hosts[1])
    assert _ask(c, 0, "h2", timeout=1.0) == "unreachable TimeoutError"  # dropped, not refused
    c.heal(c.hosts[1])
    deadline = time.monotonic() + 10
    while (answer := _ask(c, 0, "h2")).startswith("unreachable") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answer.startswith("h2 ")
    assert c.pids(c.hosts[1])
    c.kill_host(c.hosts[1])
    assert c.pids(c.hosts[1]) == []
    assert server.wait(5) == -9


def test_close_leaves_nothing_even_with_processes_running(tmp_path: Path) -> None:
    from tests.cluster._hosts import unavailable

    if (why := unavailable()) is not None:
        pytest.skip(why)
    c = Cluster(tmp_path, 2)
    c.start(c.hosts[0], ["sleep", "600"], log=tmp_path / "a.log")
    assert leftovers(c.id)
    c.close()
    assert leftovers(c.id) == []
