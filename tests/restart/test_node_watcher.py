"""One watcher process per node (the helper outside ``trainguard launch``), 4 real ranks on this host: it
watches every rank (one process, no torch), writes a dead rank's notice at once, kills a rank
hung holding the GIL at the hard timeout, and exits when its last rank has left."""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

import pytest

from tests._dist import run_ranks
from tests.restart import _faults
from tests.restart._barrier_records import left_at
from tests.restart.test_faults import _check_shrunk
from trainguard.events import read_events

STEPS = 10
FAULT_STEP = 4


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# the death notice needs no short timeouts (a loaded machine then kills a starved rank)
_SLOW = {"soft_timeout": 10.0, "hard_timeout": 20.0}


@pytest.mark.parametrize(
    ("kind", "within", "overrides"), [("sigkill", 2.0, _SLOW), ("gil", 3.0 + 1.0 + 2.0, None)]
)
def test_one_watcher_per_node_keeps_the_sidecar_guarantees(
    kind: str, within: float, overrides: dict[str, float] | None, tmp_path
) -> None:
    victim = 2
    results = run_ranks(
        _faults.fault_job,
        4,
        args=(STEPS, victim, FAULT_STEP, kind, str(tmp_path), overrides),
        timeout=120,
    )
    fault_time = float((tmp_path / f"fault-{victim}").read_text())
    assert results[victim].exitcode in ((-9,) if kind == "sigkill" else (-15, -9))
    _check_shrunk(results, victim, fault_time, within=within)
    # one watcher process watched all four ranks; no sidecar process per rank
    assert not list(tmp_path.glob("sidecar-[0-9]*.log"))
    (log,) = tmp_path.glob("sidecar-node-*.log")
    text = log.read_text()
    watched = re.findall(r"node watcher pid (\d+) .* watching rank (\d+) ", text)
    assert sorted(int(r) for _, r in watched) == [0, 1, 2, 3], text
    assert len({pid for pid, _ in watched}) == 1, text
    # the ranks learned the round's outcome and layout from it, one store read for all four
    assert re.search(r"relayed round 0's outcome to 4 rank", text), text
    assert re.search(r"relayed round 1's layout to \d rank", text), text
    pid = int(watched[0][0])
    if kind == "sigkill":
        assert "notice written" in text, text
        gone = [e for e in read_events(tmp_path) if e["kind"] == "rank_gone"]
        assert [(e["gone_rank"], e["counted"]) for e in gone] == [(victim, True)]
    else:
        assert "hard timeout" in text, text
        kills = [e for e in read_events(tmp_path) if e["kind"] == "hard_timeout"]
        assert [e["killed_rank"] for e in kills] == [victim]
    # the last rank has left: the watcher exits by itself
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"the node watcher (pid {pid}) outlived its ranks"


# A rank that registers with the node watcher and is killed before it reads the reply: its
# end reaches the watcher as a reset connection, not an end of stream.
_DIES_UNREAD = r"""
import os, signal, sys
from trainguard.coord.keys import Keyspace
from trainguard.restart.config import WrapperConfig
from trainguard.restart._helper import HelperHandle, Transport
from trainguard.restart.sidecar import SidecarConfig
cfg = WrapperConfig(soft_timeout=20, hard_timeout=60, heartbeat_timeout=10)
config = SidecarConfig.build(cfg, rank=1, world=2, keys=Keyspace("unread", 0, sys.argv[3]),
                             addr=("127.0.0.1", int(sys.argv[1])), log_dir=sys.argv[2])
handle = HelperHandle(config, Transport.node_watcher(config)).start()
assert handle.sock is not None, handle.error
print(handle.watcher_pid or "", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _rank_that_dies_unread(port: int, tmp_path: Path, secret: str) -> None:
    """Run :data:`_DIES_UNREAD` as rank 1 of call ``unread`` under ``secret`` until its end.
    A watcher it starts inherits its stderr: a file, not a pipe that would stay open (and
    keep this waiting) until the watcher ends."""
    import subprocess
    import sys

    with open(tmp_path / "rank.err", "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-c", _DIES_UNREAD, str(port), str(tmp_path), secret],
            stdout=subprocess.DEVNULL,
            stderr=err,
            timeout=60,
        )
    assert proc.returncode == -9, (tmp_path / "rank.err").read_text()


def test_a_rank_killed_before_it_read_the_reply_still_gets_its_notice(tmp_path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from trainguard.coord.keys import Keyspace

    # a secret of this run's own: the watcher's address derives from it, and a fixed one was
    # shared with any other test run on this machine (its rank reached that run's watcher)
    secret = secrets.token_hex(16)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    _rank_that_dies_unread(store.port, tmp_path, secret)
    keys = Keyspace("unread", 0, secret)
    assert "process died" in left_at(store, keys, 0, 1, timeout=30)
    (log,) = tmp_path.glob("sidecar-node-*.log")
    pid = int(re.findall(r"node watcher pid (\d+) ", log.read_text())[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), log.read_text()
    assert "Traceback" not in log.read_text()


def test_a_rank_dead_before_its_watcher_accepted_it_still_gets_its_notice(tmp_path) -> None:
    """The rank's connect returns once the connection is queued: it may send its
    configuration and die (and be reaped) before the watcher accepts it. Its notice is still
    written (a stopped watcher makes the order certain; before, it was refused unwatched)."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from trainguard.coord.keys import Keyspace
    from trainguard.restart._helper import HelperHandle, Transport
    from trainguard.restart.config import WrapperConfig
    from trainguard.restart.sidecar import SidecarConfig

    secret = secrets.token_hex(16)
    keys = Keyspace("unread", 0, secret)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    cfg = WrapperConfig(soft_timeout=20, hard_timeout=60, heartbeat_timeout=10)
    first = SidecarConfig.build(
        cfg, rank=0, world=2, keys=keys, addr=("127.0.0.1", store.port), log_dir=str(tmp_path)
    )
    watcher = HelperHandle(
        first, Transport.node_watcher(first)
    ).start()  # this process is rank 0: it keeps the watcher up
    watcher.handshake(30)
    assert watcher.watcher_pid
    os.kill(watcher.watcher_pid, signal.SIGSTOP)
    try:
        _rank_that_dies_unread(store.port, tmp_path, secret)  # and is reaped
    finally:
        os.kill(watcher.watcher_pid, signal.SIGCONT)
    try:
        why = left_at(store, keys, 0, 1, timeout=30)
        assert "process died" in why, why
        assert "before its node watcher took it" in why, why
    finally:
        watcher.stop(10)


def test_the_watcher_s_loss_takes_its_ranks_out_and_leaves_none_waiting(tmp_path) -> None:
    """The ranks wait for their rounds' outcomes through the watcher's relay: when it dies,
    every rank of the node sees it and leaves with SidecarLostError; none waits on."""
    start = time.monotonic()
    results = run_ranks(
        _faults.fault_job,
        2,
        args=(STEPS, 1, FAULT_STEP, "watcher", str(tmp_path), _SLOW),
        timeout=90,
    )
    for r in results:
        assert r.exc_type == "trainguard.errors.SidecarLostError", r.traceback
        assert "watcher" in (r.error or ""), r.error
    assert time.monotonic() - start < 60


def test_the_watcher_s_ranks_beat_on_one_store_connection() -> None:
    """The node watcher's connections to the store process do not grow with its ranks: one
    for every rank's heartbeats, one or two for the relay's waits (it had one per rank)."""
    from bench import _coord_conns

    results = run_ranks(
        _coord_conns.count_connections,
        4,
        args=(0.5,),
        timeout=120,
    )
    counts = [r.get() for r in results]
    assert all(c["helpers"] <= 3 for c in counts), counts  # was 4 + the relay's
    assert all(c["helpers"] >= 1 for c in counts), counts  # the watcher was counted at all
