"""The node watcher and the agent's transport, run on their own against a real store and real
processes they watch: the configuration never shows in a command line, the watcher signals
through its pidfd, its log cannot be planted, and a socket name squatted by another process
gets nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.restart._barrier_records import left_at
from trainguard.coord import Keyspace
from trainguard.errors import CoordinationError
from trainguard.restart._helper import HelperHandle, Transport
from trainguard.restart.config import WrapperConfig
from trainguard.restart.policy import ShiftRanks
from trainguard.restart.sidecar import SidecarConfig, _node


@pytest.fixture()
def store() -> Iterator[Any]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    yield server
    del server


def _config(
    store: Any, parent: int, *, rank: int = 0, world: int = 3, log_dir: Any = None, **timeouts: Any
) -> SidecarConfig:
    cfg = WrapperConfig(
        rank_assignment=ShiftRanks(),  # a policy that pickles: it travels to the sidecar
        **{"soft_timeout": 20, "hard_timeout": 60, "heartbeat_timeout": 10, **timeouts},
    )
    config = SidecarConfig.build(
        cfg,
        rank=rank,
        world=world,
        # a secret of this store's: the node watcher's address derives from the keyspace, and
        # another test run on this machine must not reach this one's watcher
        keys=Keyspace("sec", 0, f"port{store.port}"),
        addr=("127.0.0.1", store.port),
        log_dir=log_dir,
    )
    return dataclasses.replace(config, parent=parent)


def _node_watcher(config: SidecarConfig) -> HelperHandle:
    """This process's handle of the node watcher of ``config``'s call, past its handshake."""
    handle = HelperHandle(config, Transport.node_watcher(config)).start()
    handle.handshake(60)
    return handle


# A watched rank of its own process (the watcher watches the process that connected): it
# registers, tells the watcher its round, prints the watcher's pid and sends no more lines.
_WATCHED = r"""
import dataclasses, json, os, sys, time
from trainguard.restart._helper import HelperHandle, Transport
from trainguard.restart.sidecar import SidecarConfig
config = SidecarConfig.from_json(json.loads(sys.argv[1]))
config = dataclasses.replace(config, parent=os.getpid())
handle = HelperHandle(config, Transport.node_watcher(config)).start()
handle.handshake(60)
handle.send({"round": 0, "roster": [0, 1, 2]})
print(handle.watcher_pid, flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _watched(config: SidecarConfig) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A process that the node watcher watches as ``config``'s rank (its pid goes in), and
    the watcher's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WATCHED, json.dumps(config.to_json())], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), line
        yield proc, int(line)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_configuration_is_not_on_the_command_line(store) -> None:
    config = _config(store, os.getpid())
    assert config.policies  # the pickled policies are part of it
    handle = _node_watcher(config)
    try:
        assert handle.watcher_pid is not None
        cmdline = Path(f"/proc/{handle.watcher_pid}/cmdline").read_bytes()
        assert cmdline.split(b"\0")[-2:] == [b"trainguard.restart.sidecar", b""], cmdline
        assert config.policies.encode() not in cmdline and b"{" not in cmdline
    finally:
        handle.stop(10)


def test_hard_timeout_kills_the_watched_process_through_its_pidfd(store) -> None:
    # no watchdog line ever comes: at the hard timeout the watcher sends SIGTERM
    config = _config(
        store,
        -1,
        soft_timeout=0.5,
        hard_timeout=1.5,
        heartbeat_interval=0.1,
        termination_grace_time=5.0,
    )
    with _watched(config) as (proc, _):
        assert proc.wait(30) == -signal.SIGTERM


def test_a_planted_log_path_is_not_written_through(store, tmp_path) -> None:
    """The watcher's log in the events directory is a link planted there: the watcher does
    not write through it (it logs to stderr) and watches all the same."""
    events = tmp_path / "events"
    events.mkdir()
    target = tmp_path / "victim"
    target.write_text("")
    config = _config(store, os.getpid(), log_dir=str(events))
    _node.log_path(config).symlink_to(target)
    handle = _node_watcher(config)
    try:
        assert handle.alive()
    finally:
        handle.stop(10)
    assert target.read_text() == "" and _node.log_path(config).is_symlink()


@pytest.mark.parametrize("from_env", [False, True])
def test_every_key_of_a_job_holds_its_secret(from_env: bool) -> None:
    from tests._dist import run_ranks
    from tests.restart._secjobs import secret_job

    env = {"TRAINGUARD_JOB_ID": "sj"}
    if from_env:
        env["TRAINGUARD_JOB_SECRET"] = "given-by-the-launcher-0123"
    results = run_ranks(secret_job, 2, env=env, timeout=120)
    values = [r.get() for r in results]
    secret = values[0]["secret"]
    assert [v["secret"] for v in values] == [secret, secret]
    for v in values:
        assert v["with"] and not v["without"] and not v["in_cmdline"], v
    if from_env:
        assert secret == env["TRAINGUARD_JOB_SECRET"] and values[0]["handover"] is None
    else:  # handed over through a private file: the store holds only a digest
        assert len(secret) == 32 and values[0]["handover"] == values[0]["digest"] != secret


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_the_node_watcher_runs_without_torch_and_writes_the_death_notice(store) -> None:
    config = _config(store, -1, heartbeat_interval=0.1)
    keys = config.keys
    with _watched(config) as (proc, watcher):
        maps = Path(f"/proc/{watcher}/maps").read_text()
        assert "libtorch" not in maps  # the wire client: no torch import for the store
        assert _rss_mb(watcher) < 100  # a torch import alone takes ~200 MB
        proc.kill()
        killed = time.monotonic()
        assert "process died" in left_at(store, keys, 1, 0)
        assert time.monotonic() - killed < 10  # the notice waits for no heartbeat timeout
        outcome = json.loads(bytes(store.get(keys.stop(0))))
        assert outcome["type"] == "RankGone" and outcome["rank"] == 0, outcome
        deadline = time.monotonic() + 20  # its last rank has left: it exits
        while Path(f"/proc/{watcher}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{watcher}").exists(), "the watcher outlived its last rank"


def test_a_forged_complete_outcome_never_swallows_a_ranks_exception() -> None:
    from tests._dist import run_ranks
    from tests.restart._secjobs import forged_complete_job

    env = {"TRAINGUARD_JOB_ID": "forged", "TRAINGUARD_JOB_SECRET": "known-to-the-forger-0123"}
    results = run_ranks(forged_complete_job, 2, env=env, timeout=120)
    assert results[0].get() == 7  # it returned: the store said the round completed
    assert not results[1].returned or results[1].exc_type is not None, "rank 1 returned normally"
    assert results[1].exc_type == "builtins.ValueError", (results[1].exc_type, results[1].error)
    assert "rank 1 failed in round 0" in (results[1].error or "")


def _squat(name: str, user: int | None, out: int) -> None:
    """The forked child of :func:`_squatter`: it never returns."""
    try:
        if user is not None:
            os.setuid(user)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)
        sock.listen(8)
        os.write(out, b"ready\n")
        data = b""
        if select.select([sock], [], [], 30)[0]:
            conn, _ = sock.accept()
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    data += chunk
        os.write(out, data.hex().encode() + b"\n")
    finally:
        os._exit(0)


@contextlib.contextmanager
def _squatter(name: str, *, user: int | None) -> Iterator[Callable[[], bytes]]:
    """A process that took the abstract socket name ``name`` first (forked, then running as
    ``user``); yields a call that returns every byte it was sent, once its connection closed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _squat(name, user, w)
    os.close(w)
    reader = os.fdopen(r, "rb")
    try:
        assert reader.readline() == b"ready\n"
        yield lambda: bytes.fromhex(reader.readline().decode().strip())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reader.close()


def _secret_config(store: Any) -> SidecarConfig:
    config = _config(store, os.getpid())
    secret = "a-secret-the-squatter-must-not-see-0123"
    return dataclasses.replace(config, job="sq", secret=secret)


def test_a_node_watcher_socket_held_by_another_user_gets_nothing(store) -> None:
    config = _secret_config(store)
    with _squatter(_node.address(config.keys), user=65534) as received:  # binds it first
        sidecar = HelperHandle(config, Transport.node_watcher(config)).start()
        with pytest.raises(CoordinationError) as refused:
            sidecar.handshake(5)
        assert config.secret.encode() not in received()
        assert "runs as user 65534, not as" in str(refused.value)


@pytest.mark.parametrize("user", [65534, None])
def test_an_agent_socket_held_by_another_process_gets_nothing(store, user) -> None:
    # another user's listener, or one of this user that is not the rank's parent (its child)
    config = _secret_config(store)
    name = f"trainguard-agent-squatted-{os.getpid()}"
    with _squatter(name, user=user) as received:
        sidecar = HelperHandle(config, Transport.agent(name)).start()
        why = "runs as user 65534" if user else "is not this process's parent"
        with pytest.raises(CoordinationError) as refused:
            sidecar.handshake(5)
        assert received() == b""
        assert why in str(refused.value)


def _holds_pidfd(holder: int, pid: int) -> bool:
    """Whether process ``holder`` has a pidfd of ``pid`` open."""
    for info in Path(f"/proc/{holder}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            if f"\nPid:\t{pid}\n" in info.read_text():
                return True
    return False


def _connect_and_hand_over(address: str, go: socket.socket, out: socket.socket) -> None:
    """Forked child: connect to the node watcher, hand the connection to the test process
    (``out``), exit when told (``go``). Never returns."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + address)
        socket.send_fds(out, [b"c"], [sock.fileno()])
        go.recv(1)
    finally:
        os._exit(0)


def test_the_node_watcher_never_signals_the_next_owner_of_a_dead_ranks_pid(store) -> None:
    # a rank connects, hands its connection on and dies; its pid goes to another process
    # before its configuration arrives: the watch is of the process that connected
    from tests._dist import process_with_pid

    first = _config(store, os.getpid())  # keeps the watcher up; its hard timeout is far
    watcher = HelperHandle(first, Transport.node_watcher(first)).start()
    watcher.handshake(30)
    assert watcher.watcher_pid is not None
    go, go_child = socket.socketpair()
    fds, fds_child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        _connect_and_hand_over(_node.address(first.keys), go_child, fds_child)
    _, [fd], _, _ = socket.recv_fds(fds, 1, 1)
    conn = socket.socket(fileno=fd)
    deadline = time.monotonic() + 5  # until the watcher holds a pidfd of it (its accept)
    while not _holds_pidfd(watcher.watcher_pid, pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    go.send(b"x")
    os.waitpid(pid, 0)  # the rank is gone and reaped: its pid is free
    victim = process_with_pid(pid, time.monotonic() + 5)
    try:
        assert victim is not None, f"pid {pid} could not be had"
        config = _config(
            store,
            pid,
            rank=1,
            soft_timeout=0.5,
            hard_timeout=1.5,
            termination_grace_time=0.5,
            heartbeat_interval=0.1,
        )
        conn.sendall(json.dumps(config.to_json()).encode() + b"\n")
        deadline = time.monotonic() + 1.5 + 0.5 + 2.0  # past its hard timeout and grace
        while victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim.poll() is None, f"the watcher signalled pid {pid}'s next owner"
        assert watcher.alive()
    finally:
        if victim is not None:
            victim.kill()
            victim.wait()
        for sock in (conn, go, go_child, fds, fds_child):
            sock.close()
        watcher.stop(10)
