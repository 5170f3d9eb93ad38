"""A ``trainguard launch`` job on emulated hosts: one agent per host, its workers on that host.

    with cluster(3) as hosts:                    # the fixture of conftest.py
        job = HostJob(hosts, tmp_path, nproc=2, worker=["wrapper", str(out), "--active=4"])
        job.start()
        job.wait_for(lambda: ..., what="...")
        codes = job.wait(timeout=60)

Agents rendezvous (c10d) on the first host by its host name, as on a cluster (no
``--local-addr``: every address is found the way a user's job finds it). The workers are the
launcher tests' workers (``tests/launch/_workers.py``); their files go to a directory every
host sees (the test's temporary directory), as a shared file system would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.cluster._hosts import Cluster, Host

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "launch" / "_workers.py")
RDZV_PORT = 29400  # every host is a network namespace of its own: nothing else listens there
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` ([] when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class HostJob:
    """Agents of one job on the hosts of ``cluster`` (see the module docstring).

    ``extra``: more launcher options for every agent; ``env``: more environment variables;
    ``store_host``: the host of the rendezvous (default the first).
    """

    def __init__(
        self,
        cluster: Cluster,
        tmp: Path,
        *,
        nproc: int,
        worker: Sequence[str],
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        hosts: Sequence[Host] | None = None,
        rdzv_host: Host | None = None,
        timeout: float = 120.0,
        module: str = "trainguard.launch",
        nodes: str | None = None,
    ) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.hosts = list(cluster.hosts if hosts is None else hosts)
        self.rdzv_host = rdzv_host or self.hosts[0]
        self.nproc, self.worker, self.extra = nproc, list(worker), list(extra)
        self.module, self.nodes = module, nodes  # torchrun: "torch.distributed.run", "2:3"
        self.run_id = f"tgcl-{uuid.uuid4().hex[:10]}"
        # a job on several hosts needs a secret (the launcher refuses to start without one)
        secret = {"TRAINGUARD_JOB_SECRET": uuid.uuid4().hex}
        self.env = dict(os.environ, TG_TEST_RUN=self.run_id, **{**secret, **(env or {})})
        self.env = {k: v for k, v in self.env.items() if v != "-"}  # "-": leave it out
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "src"), str(ROOT), self.env.get("PYTHONPATH", "")) if p
        )
        self.deadline = time.monotonic() + timeout
        self.agents: dict[str, subprocess.Popen[bytes]] = {}  # log name -> process
        self.logs: list[Path] = []

    def command(self, host: Host) -> list[str]:
        is_host = int(host == self.rdzv_host)
        return [
            sys.executable,
            "-m",
            self.module,
            f"--nnodes={self.nodes or len(self.hosts)}",
            f"--nproc-per-node={self.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_host.name}:{RDZV_PORT}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={is_host},{RDZV_CONF}",
            "--monitor-interval=0.05",
            *self.extra,
            WORKER,
            *self.worker,
        ]

    def start(self) -> None:
        """One agent on every host of the job."""
        for host in self.hosts:
            self.add(host)

    def add(self, host: Host, *, name: str | None = None, extra: Sequence[str] = ()) -> str:
        """Start an agent on ``host`` (also: a replacement host while the job runs); returns
        the name of its log."""
        name = name or host.name
        cmd = self.command(host)
        cmd[-len(self.worker) - 1 : -len(self.worker) - 1] = list(extra)
        log = self.tmp / f"agent-{name}.log"
        self.logs.append(log)
        self.agents[name] = self.cluster.start(host, cmd, log=log, env=self.env, cwd=ROOT)
        return name

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def wait_for(self, cond: Callable[[], Any], *, timeout: float = 60.0, what: str = "") -> Any:
        """Poll ``cond`` until it returns something truthy; fail with the logs on timeout."""
        end = time.monotonic() + min(timeout, self.left())
        while time.monotonic() < end:
            value = cond()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what or cond}\n{self.output()}")

    def wait(
        self, names: Sequence[str] | None = None, timeout: float | None = None
    ) -> dict[str, int]:
        """Exit codes of the agents (``names``: those only); fails past the limit."""
        end = time.monotonic() + (self.left() if timeout is None else min(timeout, self.left()))
        codes = {}
        for name in names or list(self.agents):
            p = self.agents[name]
            try:
                codes[name] = int(p.wait(max(0.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"agent {name} still running at the limit\n{self.output()}"
                ) from None
        return codes

    def output(self, lines: int = 50) -> str:
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            kept = [
                ln
                for ln in text.splitlines()
                if "OMP_NUM_THREADS" not in ln and "****" not in ln and "waitForInput" not in ln
            ]
            parts.append(f"--- {log.name} ---\n" + "\n".join(kept[-lines:]))
        return "\n".join(parts)
