"""Store calls of threads bound to a round, against the abort that shuts the round's connections.

The CI failure behind it: ``examples/restart_plain.py`` printed a C++ stack trace after a
fault because the local checkpoint thread's ``check`` was on the wire when the monitor shut the
round's store connections (torch logs the cut call with its backtrace). The store server runs in
a process of its own, and ``SIGSTOP`` holds its answer back, so that the call is surely in flight
when the round is aborted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from trainguard import _aborts
from trainguard.restart.abort import shutdown_connections_to

pytestmark = pytest.mark.timeout(60)

_SERVER = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: a thread still running
    for a moment after the signal would answer the call."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tasks = Path(f"/proc/{pid}/task")
        states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks.iterdir()]
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop: {states}")


def _bound(port: int) -> Any:
    """A client of the server on ``port``, bound to the current round (as a pipeline's)."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return _aborts.bound(client, _aborts.count())


def _in_flight(store: Any) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}

    def call() -> None:
        try:
            got["value"] = store.check(["k"])
        except Exception as exc:
            got["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.2)  # on the wire: the server is stopped
    assert thread.is_alive(), got
    return thread, got


def test_an_abort_waits_for_the_call_in_flight_then_refuses_the_next(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = server
    store = _bound(port)
    assert store.check(["k"]) is False  # a call of a live round goes through
    _stop(proc.pid)
    thread, got = _in_flight(store)
    threading.Timer(0.3, os.kill, (proc.pid, signal.SIGCONT)).start()
    start = time.monotonic()
    _aborts.note()  # as the monitor does, then it shuts the round's connections
    waited = time.monotonic() - start
    shutdown_connections_to("127.0.0.1", port)
    thread.join(10)
    assert got == {"value": False}, got  # answered, not cut by the shutdown
    assert 0.1 < waited < _aborts.IN_FLIGHT_WAIT_S + 0.2, waited
    with pytest.raises(_aborts.RoundOver, match="round was aborted"):
        store.check(["k"])  # never sent on the shut connection


def test_a_call_that_never_ends_holds_the_abort_only_so_long(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = server
    store = _bound(port)
    _stop(proc.pid)  # a store host that stopped answering
    thread, got = _in_flight(store)
    start = time.monotonic()
    _aborts.note(wait=0.3)
    waited = time.monotonic() - start
    assert 0.25 < waited < 2.0, waited
    shutdown_connections_to("127.0.0.1", port)  # the abort cuts it, as it must
    thread.join(10)
    assert not thread.is_alive() and "error" in got, got


def test_a_store_bound_to_a_later_round_is_not_refused(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    _, port = server
    _aborts.note(wait=0)
    store = _bound(port)  # the next round's pipeline
    store.set("k", "v")
    assert store.get("k") == b"v" and store.port == port  # attributes pass through
