"""Emulated hosts for tests: network namespaces on a bridge, each a host of its own.

A :class:`Cluster` of N hosts is, for real:

- one Linux bridge in this machine's network namespace, with the address ``<net>.254``;
- per host a network namespace joined to the bridge by a veth pair, with the address
  ``<net>.<i>`` (``i`` from 1) in ``198.18.0.0/15``, the range set aside for network benchmarks
  (RFC 2544), so never a real network; its loopback is up;
- per host a host name (``h1``, ``h2``, ...; every command starts in a UTS namespace of its own
  that carries it) and an ``/etc/hosts`` that names every host (``ip netns exec`` binds
  ``/etc/netns/<ns>/hosts`` over ``/etc/hosts`` in a mount namespace of its own);
- per host a node-local directory (:attr:`Host.local`) under the test's temporary directory.

The processes are real, their TCP connections cross real interfaces, and :meth:`Cluster.cut`
takes a host's link down: a real partition (packets are dropped, no connection is reset), which
:meth:`Cluster.heal` ends. :meth:`Cluster.kill_host` SIGKILLs every process of a host (what a
host that loses power does to its processes). :meth:`Cluster.close` kills every process of
every host and removes every namespace, link and file it made, even when a test failed;
:func:`leftovers` lists what is left of clusters (the fixture in ``conftest.py`` asserts there is
nothing).

    with Cluster(tmp_path, 3) as cluster:
        p = cluster.start(cluster.hosts[0], [sys.executable, "-c", "..."], log=tmp_path / "h1")
        cluster.cut(cluster.hosts[2])
        ...

Needs root and ``ip`` (iproute2) and ``unshare`` (util-linux): :func:`unavailable` says what is
missing, for a skip reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

#: every name this module gives a namespace, a link or a directory starts with it
PREFIX = "tgc"
NETNS_ETC = Path("/etc/netns")


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, a bridge, veth links)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` on PATH (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _used_nets() -> set[str]:
    """The /24 networks of 198.18.0.0/15 that some interface of this machine already uses."""
    out = _ip("-o", "-4", "addr", "show").stdout
    nets = set()
    for line in out.splitlines():
        for word in line.split():
            if word.startswith("198.18.") or word.startswith("198.19."):
                nets.add(word.rsplit(".", 1)[0])
    return nets


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated host: its index (0-based), host name, address, namespace, link, local dir."""

    index: int
    name: str
    addr: str
    netns: str
    link: str  # the veth end on the bridge: down = partitioned
    local: Path


class Cluster:
    """``n`` emulated hosts on one bridge (see the module docstring).

    Args:
        tmp: a directory for the hosts' local directories and logs.
        n: the number of hosts.
    """

    def __init__(self, tmp: Path, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: between 1 and 200 hosts")
        self.id = uuid.uuid4().hex[:5]
        self.bridge = f"{PREFIX}{self.id}br"
        used = _used_nets()
        free = [
            f"198.{18 + a // 256}.{a % 256}"
            for a in range(1, 511)
            if f"198.{18 + a // 256}.{a % 256}" not in used
        ]
        self.net = random.choice(free)
        self.gateway = f"{self.net}.254"
        self.hosts = [
            Host(
                index=i,
                name=f"h{i + 1}",
                addr=f"{self.net}.{i + 1}",
                netns=f"{PREFIX}{self.id}n{i + 1}",
                link=f"{PREFIX}{self.id}v{i + 1}",
                local=tmp / "hosts" / f"h{i + 1}",
            )
            for i in range(n)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._netns: dict[int, str] = {}  # pid of a started process -> the host it was started on
        self._closed = False
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # making and unmaking ---------------------------------------------------------------------
    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.link, "master", self.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            h.local.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Kill every process of every host, remove the namespaces, links and files. Idempotent;
        safe after a partial :meth:`__init__`."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            self.kill_host(h)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
            if p.poll() is None:  # a process that had not even entered its host's namespace
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)
            shutil.rmtree(NETNS_ETC / h.netns, ignore_errors=True)
            _ip("link", "del", h.link, check=False)
        _ip("link", "del", self.bridge, check=False)
        # namespaces go away asynchronously once their last process is gone
        end = time.monotonic() + 10
        while time.monotonic() < end and leftovers(self.id):
            time.sleep(0.05)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # using the hosts -------------------------------------------------------------------------
    def start(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` "on" ``host`` (its network, host name and ``/etc/hosts``), in a
        session of its own, stdout and stderr to ``log``; ``env``: its whole environment
        (default: this process's)."""
        wrapped = [
            "ip", "netns", "exec", host.netns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *argv,
        ]  # fmt: skip
        with open(log, "ab") as f:
            p = subprocess.Popen(
                wrapped,
                env=dict(os.environ if env is None else env),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
            )
        self.procs.append(p)
        self._netns[p.pid] = host.netns
        return p

    def run(self, host: Host, argv: Sequence[str], *, timeout: float = 30) -> str:
        """Run ``argv`` on ``host`` to its end; its output (raises if it fails)."""
        wrapped = [
            "ip", "netns", "exec", host.netns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *argv,
        ]  # fmt: skip
        done = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} on {host.name} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def pids(self, host: Host) -> list[int]:
        """The processes that run on ``host`` now (in its network namespace)."""
        out = _ip("netns", "pids", host.netns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process of ``host`` (until none is left); returns what was killed."""
        killed: list[int] = []
        for _ in range(20):
            pids = self.pids(host)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += pids
            time.sleep(0.05)
        for p in self.procs:
            # started on it: also one still in `ip netns exec`, not yet in the namespace
            if p.poll() is None and self._netns.get(p.pid) == host.netns:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        return killed

    def cut(self, host: Host) -> None:
        """Partition ``host`` from every other host (its link down; connections hang)."""
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        """End :meth:`cut`: ``host``'s link up again."""
        _ip("link", "set", host.link, "up")


def leftovers(cluster_id: str = "") -> list[str]:
    """What is left of clusters (all, or the one with ``cluster_id``): namespaces, links, files
    under ``/etc/netns``, processes in a cluster's namespace."""
    mark = PREFIX + cluster_id
    found = [
        f"netns {n}" for n in _ip("netns", "list", check=False).stdout.split() if n.startswith(mark)
    ]
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(mark):
            found.append(f"link {name}")
    if NETNS_ETC.is_dir():
        found += [f"file {p}" for p in NETNS_ETC.iterdir() if p.name.startswith(mark)]
    for n in [x.split()[-1] for x in found if x.startswith("netns ")]:
        pids = _ip("netns", "pids", n, check=False).stdout.split()
        found += [f"process {p} in {n}" for p in pids]
    return found
