"""The agent's sidecar service with real processes: plain-Python workers that speak its protocol
against a real store, and real Wrapper jobs (gloo, 3 ranks) that connect to it instead of
starting sidecar processes. The test process stands in for the agent: it announces the ranks
(``expect``) and reports their deaths (``died``) the way the agent does."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._dist import RankGroup, live_processes, proc_stat
from tests.restart import _faults, _jobs
from tests.restart._barrier_records import left_at, record_at
from trainguard.coord import Keyspace
from trainguard.coord.store import connect
from trainguard.errors import CoordinationError
from trainguard.restart._helper import HelperHandle, Transport
from trainguard.restart._records import RoundLayout
from trainguard.restart.config import WrapperConfig
from trainguard.restart.policy import ShiftRanks
from trainguard.restart.sidecar import SidecarConfig, SidecarService

STEPS = 10
FAULT_STEP = 4

# A worker that speaks the protocol without importing anything of ours: it leads its own
# process group (as torchrun's workers do) with a child in it, handles SIGTERM (exit 7), sends
# its configuration (stdin) to the agent and prints the reply; "stop" then stops itself.
_WORKER = r"""
import json, os, signal, socket, subprocess, sys, time
cfg = json.loads(sys.stdin.readline())
cfg["parent"] = os.getpid()
child = subprocess.Popen(["sleep", "120"])
signal.signal(signal.SIGTERM, lambda *a: os._exit(7))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + os.environ["TRAINGUARD_AGENT"])
s.sendall(json.dumps(cfg).encode() + b"\n")
reply = s.makefile("rb").readline()
print(json.dumps({"reply": json.loads(reply or b"null"), "child": child.pid}), flush=True)
if sys.argv[1] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def store_addr() -> Iterator[tuple[str, int]]:
    """A coordination store in a process of its own (its connections are not this process's)."""
    code = (
        "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True); "
        "print(s.port, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    proc.stdout.close()
    yield ("127.0.0.1", port)
    proc.kill()
    proc.wait()


@pytest.fixture()
def service(tmp_path: Path) -> Iterator[SidecarService]:
    svc = SidecarService(name="test", log_dir=str(tmp_path / "agent"), rejoin_timeout=30)
    svc.start()
    yield svc
    svc.close()


def _config(addr: tuple[str, int], job: str, **timeouts: float) -> SidecarConfig:
    cfg = WrapperConfig(
        rank_assignment=ShiftRanks(),
        **{"soft_timeout": 20, "hard_timeout": 60, "heartbeat_timeout": 10, **timeouts},
    )
    return SidecarConfig.build(cfg, rank=0, world=3, keys=Keyspace(job), addr=addr, log_dir=None)


def _log(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in (tmp_path / "agent").glob("sidecar-service-*.log"))


@contextlib.contextmanager
def _worker(
    service: SidecarService, config: SidecarConfig, mode: str
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """A plain worker, announced to the service right after its Popen; yields its reply."""
    env = {**os.environ, "TRAINGUARD_AGENT": service.address}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    service.expect(0, proc.pid, 0)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(config.to_json()).encode() + b"\n")
    proc.stdin.close()
    try:
        yield proc, json.loads(proc.stdout.readline())
    finally:
        proc.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _dead(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def test_hard_timeout_continues_and_kills_the_workers_group(store_addr, service, tmp_path):
    # no line ever comes and the worker stopped itself: at the hard timeout SIGCONT, then
    # SIGTERM to its group (its handler runs: exit 7; its child dies with it). A SIGTERM sent
    # at once after the SIGCONT was lost about one run in four beside two CPU hogs (gVisor):
    # the worker resumed (stopped -> sleeping below) and died of the SIGKILL; the watch now
    # waits until the worker no longer shows as stopped before it sends the SIGTERM.
    config = _config(store_addr, "hard", soft_timeout=1.5, hard_timeout=6.0, heartbeat_interval=0.2)
    with _worker(service, config, "stop") as (proc, hello):
        assert hello["reply"]["ok"] is True and hello["reply"]["pid"] == os.getpid()
        start, states = time.monotonic(), []  # the worker's state as it changes: (time, state)
        while proc.poll() is None and time.monotonic() - start < 30:
            stat = proc_stat(proc.pid)
            state = stat[0] if stat else None
            if not states or states[-1][1] != state:
                states.append((round(time.monotonic() - start, 2), state))
            time.sleep(0.05)
        assert proc.wait(20) == 7, states
        deadline = time.monotonic() + 10
        while not _dead(hello["child"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _dead(hello["child"]), "the worker's group was not signalled"
        assert service.died(0, proc.pid, 7, returning=False, timeout=20) is True
    log = _log(tmp_path)
    assert "killed by the launcher at the hard timeout (no progress" in log, log
    keys = Keyspace("hard", 0, config.secret)
    store = connect(*store_addr, timeout=10)
    assert "hard timeout" in left_at(store, keys, 0, 0)


def test_unannounced_process_is_refused(store_addr, service, tmp_path):
    # this test process was never announced with expect(): refused after the grace period
    sidecar = HelperHandle(_config(store_addr, "refused"), Transport.agent(service.address)).start()
    with pytest.raises(CoordinationError, match="was not started by this agent"):
        sidecar.handshake(10)
    assert not sidecar.alive()
    # announced, but its configuration names another process
    service.expect(5, os.getpid(), 0)
    other = SidecarConfig.from_json({**_config(store_addr, "refused").to_json(), "parent": 1})
    sidecar = HelperHandle(other, Transport.agent(service.address)).start()
    with pytest.raises(CoordinationError, match="names pid 1"):
        sidecar.handshake(10)
    assert _log(tmp_path).count("refused a connection of pid") == 2
    bad = HelperHandle(other, Transport.agent("trainguard-no-such-agent")).start()
    with pytest.raises(CoordinationError, match="cannot reach it"):
        bad.handshake(1)


def test_goodbye_death_and_agent_loss_as_the_worker_sees_them(store_addr, tmp_path):
    service = SidecarService(name="bye", log_dir=None, rejoin_timeout=30)
    service.start()
    service.start()  # idempotent
    try:
        service.expect(1, os.getpid(), 0)
        config = _config(store_addr, "bye")
        sidecar = HelperHandle(config, Transport.agent(service.address)).start()
        sidecar.handshake(30)
        assert sidecar.alive() and sidecar.send({"round": 0, "roster": [0, 1, 2]})
        sidecar.stop(10)  # returns once the service took the goodbye
        assert not sidecar.alive() and not sidecar.send({"hb": 1})
        # it said goodbye: its death has nothing to undo
        assert service.died(1, os.getpid(), 1, returning=False, timeout=5) is False
        service.expect(1, os.getpid(), 1)
        sidecar = HelperHandle(config, Transport.agent(service.address)).start()
        sidecar.handshake(30)
        assert sidecar.alive()
    finally:
        service.close()
    assert not sidecar.alive()  # the agent is gone: the watchdog takes this rank out
    assert "launcher's agent" in sidecar.loss()
    sidecar.stop(1)


def test_gone_writes_the_notice_of_a_rank_of_a_lost_node(store_addr, service):
    config = _config(store_addr, "gone")
    with _worker(service, config, "sleep") as (_, hello):
        assert hello["reply"]["ok"] is True
        service.gone(2, "its node was lost")
        store = connect(*store_addr, timeout=10)
        keys = Keyspace("gone", 0, config.secret)
        assert left_at(store, keys, 0, 2) == "its node was lost"


def test_gone_before_any_worker_connected_is_written_once_one_connects(store_addr, service):
    """A replacement node's agent declares a node lost while its own workers still start: the
    notice waits for the first of them to connect (it used to be dropped), and starts from the
    latest round the store published."""
    config = _config(store_addr, "early")
    keys = Keyspace("early", 0, config.secret)
    store = connect(*store_addr, timeout=10)
    store.set(keys.latest, RoundLayout(round=3, active=[0, 1, 2], spare=[]).encode())
    service.gone(2, "its node was lost")
    time.sleep(0.5)
    # nothing to write it in yet
    assert record_at(store, keys, 4, 2) is None and not store.check([keys.stop(3)])
    with _worker(service, config, "sleep") as (_, hello):
        assert hello["reply"]["ok"] is True
        assert left_at(store, keys, 4, 2) == "its node was lost"
    assert "RankGone" in bytes(store.get(keys.stop(3))).decode()  # round 3 became a fault


def test_gone_while_the_only_worker_is_in_no_round_yet_starts_from_the_latest_round(
    store_addr, service
):
    """The agent's only worker connected but announced no round (a newcomer on its way in):
    the notice starts from the store's latest round, not from before round 0."""
    config = _config(store_addr, "newcomer")
    keys = Keyspace("newcomer", 0, config.secret)
    store = connect(*store_addr, timeout=10)
    store.set(keys.latest, RoundLayout(round=5, active=[0, 1, 2], spare=[]).encode())
    with _worker(service, config, "sleep") as (_, hello):
        assert hello["reply"]["ok"] is True
        service.gone(1, "its node was lost")
        assert left_at(store, keys, 6, 1) == "its node was lost"
    assert record_at(store, keys, 0, 1) is None


def test_gone_after_every_worker_said_goodbye_is_written_in_their_call(store_addr, service):
    config = _config(store_addr, "after")
    keys = Keyspace("after", 0, config.secret)
    service.expect(1, os.getpid(), 0)
    sidecar = HelperHandle(config, Transport.agent(service.address)).start()
    sidecar.handshake(30)
    sidecar.stop(10)
    service.gone(2, "its node was lost")  # before any round: at round 0's barrier
    assert left_at(connect(*store_addr, timeout=10), keys, 0, 2) == "its node was lost"


def test_close_leaves_no_thread_socket_or_store_connection(store_addr, tmp_path):
    def ours() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("tg-")}

    fds = set(os.listdir("/proc/self/fd"))
    service = SidecarService(name="close", log_dir=str(tmp_path), rejoin_timeout=30)
    service.start()
    config = _config(store_addr, "close")
    with _worker(service, config, "sleep") as (proc, hello):
        assert hello["reply"]["ok"] is True
        assert {"tg-service", "tg-conn", "tg-hard"} <= ours()
        service.close()
        assert ours() == set()
        assert proc.stdout is not None  # the one descriptor opened since: the worker's pipe
        assert set(os.listdir("/proc/self/fd")) - {str(proc.stdout.fileno())} == fds
        assert proc.poll() is None  # closing the service does not touch the workers


# Wrapper jobs (gloo) ---------------------------------------------------------------------
def _descendants(pids: list[int]) -> list[bytes]:
    """Command lines of every live descendant of ``pids``."""
    table = live_processes()
    found, frontier = [], set(pids)
    while frontier:
        frontier = {pid for pid, f in table.items() if int(f[1]) in frontier}
        for pid in frontier:
            with contextlib.suppress(OSError):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    return found


def _run_job(tmp_path: Path, service: SidecarService, victim: int, kind: str, overrides, **died):
    """3 ranks under the service; ``victim`` suffers ``kind``; the test reports its death.
    Returns (results, fault time, the survivors' descendants while the victim was dead)."""
    args = (STEPS, victim, FAULT_STEP, kind, str(tmp_path), overrides)
    env = {"TRAINGUARD_AGENT": service.address}
    with RankGroup(_faults.fault_job, 3, args=args, timeout=90, env=env) as group:
        group.start()
        for rank in range(3):
            service.expect(rank, group.pid(rank), 0)
        group.wait_until(lambda: not group.is_alive(victim), timeout=60)
        exitcode = group._procs[victim].exitcode
        helpers = _descendants([group.pid(r) for r in range(3) if r != victim])
        assert service.died(victim, group.pid(victim), exitcode, timeout=20, **died) is True
        results = group.join()
    assert not group.leftovers
    fault_time = float((tmp_path / f"fault-{victim}").read_text())
    return results, fault_time, helpers


def _check_shrunk(results, victim: int, fault_time: float, *, within: float) -> None:
    expected = _jobs.reference(STEPS, 3, switch=FAULT_STEP, after=2)
    survivors = [r for r in range(3) if r != victim]
    for new_rank, rank in enumerate(survivors):
        value = results[rank].get()
        assert value["weights"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        seen = [(x["round"], x["rank"], x["world"]) for x in value["rounds"]]
        assert seen == [(0, rank, 3), (1, new_rank, 2)]
        latency = value["rounds"][1]["entered"] - fault_time
        assert 0 < latency < within, f"rank {rank} re-entered {latency:.3f} s after the fault"


def test_killed_rank_survivors_restart_at_once_without_sidecar_processes(service, tmp_path):
    # soft 10 s, hard 20 s, heartbeats 30 s: a restart within 2 s came from the notice
    overrides = {"soft_timeout": 10.0, "hard_timeout": 20.0}
    results, fault_time, helpers = _run_job(
        tmp_path, service, 1, "sigkill", overrides, returning=False
    )
    assert results[1].exitcode == -signal.SIGKILL
    _check_shrunk(results, 1, fault_time, within=2.0)
    # the only helper process of the ranks is rank 0's store process: no sidecar
    assert helpers and all(b"trainguard.coord._server" in c for c in helpers), helpers
    assert not list(tmp_path.glob("sidecar-*.log"))
    # (every rank connected: a rank whose handshake fails raises)
    assert "rank 1 gone in round 0 (killed by signal SIGKILL)" in _log(tmp_path)
    # the ranks learned the outcomes and layouts from the agent's relay (one store read per
    # key for the node: round 0's layout and outcome, round 1's layout and outcome)
    assert service.relay_reads >= 4, service.relay_reads


def test_rank_hung_holding_the_gil_is_killed_by_the_service(service, tmp_path):
    results, fault_time, _ = _run_job(tmp_path, service, 2, "gil", None, returning=False)
    assert results[2].exitcode in (-signal.SIGTERM, -signal.SIGKILL)
    # hard_timeout 3 s (+ up to 1 s grace); the others' soft timeouts fired first
    _check_shrunk(results, 2, fault_time, within=3.0 + 1.0 + 2.0)
    # the lines stop with the GIL held ("no progress of any thread"), unless the stall the last
    # line reported reaches the hard timeout first ("the function made no progress")
    killed = re.search(r"\(killed by the launcher at the hard timeout \((.*?) for", _log(tmp_path))
    assert killed is not None, _log(tmp_path)
    assert killed[1] in ("no progress of any thread", "the function made no progress"), killed[0]


def test_respawned_slot_that_does_not_come_back_is_counted_out(tmp_path):
    service = SidecarService(name="rejoin", log_dir=str(tmp_path / "agent"), rejoin_timeout=2.0)
    service.start()
    try:
        overrides = {"soft_timeout": 10.0, "hard_timeout": 20.0}
        results, fault_time, _ = _run_job(
            tmp_path, service, 1, "sigkill", overrides, returning=True
        )
    finally:
        service.close()
    # the survivors waited for the respawn (rejoin_timeout 2 s), then went on without it
    _check_shrunk(results, 1, fault_time, within=2.0 + 3.0)
    latency = results[0].get()["rounds"][1]["entered"] - fault_time
    assert latency >= 2.0, latency
    assert "not back within rejoin_timeout=2 s" in _log(tmp_path)
