"""The coordination layer against a real TCPStore and a real store process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from tests._dist import free_port
from tests.coord import _helpers
from trainguard.coord import CommitRound, Keyspace, connect, decode, encode, wait_key
from trainguard.errors import BarrierTimeoutError, CoordinationError


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _refused(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_keyspace_separates_jobs_calls_and_rounds() -> None:
    a, b, c = Keyspace("job1"), Keyspace("job2"), Keyspace("job1", call=1)
    assert a.stop(0) != b.stop(0) and a.stop(0) != c.stop(0) and a.stop(0) != a.stop(1)
    assert all(k.startswith("tg/job1/0/r3/") for k in a.round_keys(3))
    # a round's records are one pool, which goes with the round's keys
    assert a.pool(3) in a.round_keys(3) and a.pool(3) not in a.round_keys(2)
    assert decode(encode({"x": [1, "y"]})) == {"x": [1, "y"]}
    with pytest.raises(ValueError):
        Keyspace("a/b")


def test_round_stores_are_precreated_and_closed_when_the_next_round_starts(store_process):
    _, client = store_process
    keys = Keyspace("t")
    first = wait_key(client, keys.pg_addr(0), 10).decode()
    second = wait_key(client, keys.pg_addr(1), 10).decode()
    assert first != second and not _refused(first) and not _refused(second)
    # a key written in round 0's store is invisible to round 1's
    r0 = connect(first.split(":")[0], int(first.split(":")[1]), timeout=10)
    r0.set("rank_0", b"x")
    r1 = connect(second.split(":")[0], int(second.split(":")[1]), timeout=10)
    assert not r1.check(["rank_0"])
    del r0, r1
    client.set(keys.ready(0), b"{}")  # round 0 starts; round 1's store is already up
    client.set(keys.ready(1), b"{}")  # round 1 starts: round 2's opens, round 0's closes
    third = wait_key(client, keys.pg_addr(2), 10).decode()
    assert not _refused(third)
    deadline = time.monotonic() + 10
    while not _refused(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _refused(first)
    # the store process deletes the old round's address just after closing its store
    while client.check([keys.pg_addr(0)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client.check([keys.pg_addr(0)])


def test_a_false_wake_for_the_next_round_leaves_this_round_s_store_open(store_process):
    """torch 2.13's server wakes a key's waiters on a ``compare_set`` of the key while it is
    unset. The store process once took such a wake for round 1 starting and closed round 0's
    store under ranks still using it (Broken pipe in their ``init_process_group``)."""
    _, client = store_process
    keys = Keyspace("t")
    first = wait_key(client, keys.pg_addr(0), 10).decode()
    client.set(keys.ready(0), b"{}")  # round 0 starts
    wait_key(client, keys.pg_addr(2), 10)  # ... and the store process has seen it
    for _ in range(3):  # a reader of round 1's layout that looked too early
        assert client.compare_set(keys.ready(1), "\x00absent", "\x00absent") == b"\x00absent"
        time.sleep(0.3)
    assert not _refused(first)
    assert client.check([keys.pg_addr(0)])
    assert not client.check([keys.pg_addr(3)])  # round 1 is not taken as started either


def test_a_false_wake_is_waited_through_without_waking_the_others(store):
    """A waiter woken although its key is unset waits again (it used to fail: "deleted as it
    was read"), and after one false wake looks before it reads, so that waiters do not wake
    each other for as long as the key stays unset."""
    reads = [0]

    class Counted:  # the real client; counts the compare_sets that wake the key's waiters
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name == "compare_set":
                reads[0] += 1
            return getattr(self.inner, name)

    got: list[bytes] = []
    waiters = [
        threading.Thread(target=lambda: got.append(wait_key(Counted(store.clone()), "k", 20)))
        for _ in range(3)
    ]
    for t in waiters:
        t.start()
    time.sleep(0.3)
    store.compare_set("k", "x", "y")  # unset: wakes the three waiters, sets nothing
    time.sleep(1.0)
    false_reads = reads[0]
    store.set("k", b"v")
    for t in waiters:
        t.join(20)
    assert got == [b"v"] * 3
    assert false_reads <= 3, f"{false_reads} reads of an unset key: waiters woke each other"


def test_barrier_wakes_every_rank_once_the_last_arrives(store_process):
    """A commit round is the barrier of the coordination layer: every participant reports, the
    last one decides, and every participant wakes within a round trip of that decision."""
    _, client = store_process
    n = 4
    woke: dict[int, float] = {}
    leaders = []

    def rank(i: int) -> None:
        store = client.clone()
        time.sleep(0.05 * i)
        round_ = CommitRound(store, "b", rank=i, world_size=n)
        decided = round_.report()
        outcome = decided or round_.wait(10)
        woke[i] = time.monotonic()
        assert outcome.committed
        if decided is not None:
            leaders.append(i)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert leaders == [n - 1]
    assert max(woke.values()) - woke[n - 1] < 0.05  # woken within a round trip, no polling
    with pytest.raises(BarrierTimeoutError, match="raise the timeout"):
        wait_key(client, "never/set", 0.2, what="a test barrier")
    with pytest.raises(CoordinationError, match="reports"):
        CommitRound(client, "b", rank=0, world_size=n).report()


def test_store_survives_the_process_that_started_it() -> None:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    starter = ctx.Process(target=_helpers.host_store_then_hang, args=("s", port, send))
    starter.start()
    try:
        assert recv.poll(60), "the store process did not start"
        store_pid = recv.recv()
        os.kill(starter.pid, signal.SIGKILL)  # a crash of the training process (rank 0)
        starter.join(10)
        client = connect("127.0.0.1", port, timeout=10)
        client.set("still", b"here")
        assert client.get("still") == b"here"
        addr = wait_key(client, Keyspace("s").pg_addr(0), 10).decode()
        assert not _refused(addr)
        client.set(Keyspace("s").exit, b"done")  # the job ends: the store process exits
        deadline = time.monotonic() + 10
        while _alive(store_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(store_pid)
    finally:
        if starter.is_alive():
            starter.kill()
            starter.join()


def test_an_orphaned_store_process_exits_whatever_outside_connections_hold_it() -> None:
    # rank 0 and its launcher die; someone who reached the port holds a connection open
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_helpers.launch_rank0_then_hang, args=("o", port, send))
    launcher.start()
    store_pid = None
    try:
        assert recv.poll(60), "rank 0 did not start"
        rank0 = recv.recv()
        assert recv.poll(60), "the store process did not start"
        store_pid = recv.recv()
        outside = connect("127.0.0.1", port, timeout=10)  # no secret needed to connect
        outside.set("outside", b"here")
        os.kill(rank0, signal.SIGKILL)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.join(10)
        deadline = time.monotonic() + 10
        while _alive(store_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(store_pid), "an outside connection kept the orphaned store up"
        del outside
    finally:
        if launcher.is_alive():
            launcher.kill()
            launcher.join()
        if store_pid is not None and _alive(store_pid):
            os.kill(store_pid, signal.SIGKILL)


def test_store_process_reports_a_taken_port(make_store_process) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = make_store_process("x", port, world_size=1, timeout=5)
        with pytest.raises(CoordinationError, match="could not start"):
            server.start()


_QUIET_SCRIPT = """
import sys, time
from tests._dist import free_port
from tests.coord import _helpers
from trainguard.coord import Keyspace, connect
port = free_port()
server = _helpers.store_process("quiet", port).start()
client = connect("127.0.0.1", port, timeout=10)
time.sleep(1.0)  # no round is ready: the store process's follower waits, looking further
client.set(Keyspace("quiet").exit, b"done")
assert server.join(20), "the store process did not exit"
print("done", flush=True)
"""


def test_a_store_process_waiting_for_a_round_writes_nothing_on_stderr() -> None:
    """The follower waits for the next round in short slices; torch's store client logged two
    warnings for each slice that ran out (ten lines a second in a job without faults)."""
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="WARNING")
    proc = subprocess.run(
        [sys.executable, "-c", _QUIET_SCRIPT],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout + proc.stderr
    assert "timed out" not in proc.stderr and "waitForInput" not in proc.stderr, proc.stderr
