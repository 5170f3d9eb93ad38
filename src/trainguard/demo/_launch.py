"""``trainguard demo --launch``: the demo job under ``trainguard launch``, faults from outside.

Two ``trainguard launch`` agents ("nodes" on this machine, each in a session of its own) start
2 workers each (:mod:`trainguard.demo.launched`): ranks 0 and 1 train (``FillGaps`` +
``MaxActiveWorldSize(2)``), the other 2 processes wait as spares, so losing a node leaves
enough. Every worker reports on a file of its own; the demo reads them, and the event log for
the agents' events. It drives the faults itself:

1. after a fifth of the steps it SIGKILLs the worker holding the last rank: a spare takes the
   rank at once and the worker's agent respawns it (same ``RANK``, incarnation 1); the new
   process joins the job as a spare;
2. after two fifths (held until the respawned process waits to be admitted, else one live
   rank would be left) it SIGKILLs node 1, the one without the store: its agent, every process
   under it, its local checkpoints; the other node's agent declares it lost and its ranks gone,
   and the survivors go on (the respawned process takes the free rank);
3. once they train again it starts a replacement agent with the same rendezvous id: it takes
   the lost node's place and its workers start as newcomers. The job holds a few steps on
   until they wait to be admitted (they may start slower than the job trains); as the job
   runs at full size they wait for a round boundary, which the demo makes with an injected
   exception where the job holds (:func:`~trainguard.demo.faults.request`); they are admitted
   there as spares.

The verdict is the demo's usual one (bit-identical to the fault-free run) plus a check that
each of these happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

import trainguard
from trainguard import _procfs, events
from trainguard.demo import faults as _faults
from trainguard.demo._channel import JsonlTail
from trainguard.demo._run import _free_port, _Run
from trainguard.demo.worker import DemoConfig

__all__ = ["NODES", "NPROC", "RANKS", "LaunchRun"]

NODES, NPROC, RANKS = 2, 2, 2
#: the events of the agents and workers that the demo shows
_SHOWN = ("launch_node_lost", "launch_admitted", "join_wait", "launch_escalated",
          "launch_generation")  # fmt: skip
#: the node whose loss the demo simulates (group rank 0 hosts the coordination store).
LOST_NODE = 1


class _Agent:
    """One ``trainguard launch`` process in a session of its own, its output in ``log``."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.proc.pid
        self.lost = False  # killed by the demo on purpose

    def kill(self) -> list[int]:
        """SIGKILL the agent and every process under it (its workers have sessions of their
        own); returns their pids. The agent is stopped first so that it starts nothing more."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGSTOP)
        doomed = _procfs.descendants(self.pid)
        for pid in (self.pid, *doomed):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return doomed


@dataclasses.dataclass(frozen=True)
class _Process:
    """A worker's hello: its pid, incarnation, node and agent."""

    pid: int
    incarnation: int
    node: int
    agent: int
    time: float


class LaunchRun(_Run):
    """The demo's run under ``trainguard launch`` (see the module docstring).

    ``inject``: carry out the three faults (``--no-faults``: none).
    """

    def __init__(self, cfg: DemoConfig, stream: TextIO, timeout: float, *, inject: bool) -> None:
        super().__init__(cfg, stream, timeout)
        self.run_id = f"trainguard-demo-{uuid.uuid4().hex[:12]}"
        self.rdzv_port, self.ref_port = _free_port(), _free_port()
        self.agents: list[_Agent] = []
        self.procs: dict[int, _Process] = {}
        self.step, self.round = -1, 0
        self.worker_step, self.node_step = max(1, cfg.steps // 5), max(2, 2 * cfg.steps // 5)
        self.stage = "kill worker" if inject else "done"
        self.victim = -1
        self.killed_at = 0.0
        self.lost: set[int] = set()
        self.replacement: _Agent | None = None
        self.admitted: dict[int, dict[str, Any]] = {}
        self.waiting: set[int] = set()  # processes that waited to be admitted
        self.hold_step = cfg.steps  # where the job waits for the replacement's workers
        self.log = events.EventLog(Path(cfg.out) / "events")

    # the agents ------------------------------------------------------------------------------
    def _start_agent(self, *, host: bool) -> _Agent:
        cfg = self.cfg
        config = Path(cfg.out) / "config.json"
        if not config.exists():
            config.write_text(cfg.to_json())
        conf = f"is_host={int(host)},join_timeout=60,last_call_timeout=1"
        cmd = [
            sys.executable, "-m", "trainguard.launch", f"--nnodes={NODES}",
            f"--nproc-per-node={NPROC}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.rdzv_port}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--monitor-interval=0.05",
            "--max-restarts=1", "--tg-heartbeat-interval=0.5", "--tg-heartbeat-timeout=3",
            "--tg-rejoin-timeout=30", "--tg-exit-barrier-timeout=15",
            f"--tg-events-dir={Path(cfg.out) / 'events'}",
            "-m", "trainguard.demo.launched", str(config), str(self.ref_port),
        ]  # fmt: skip
        src = str(Path(trainguard.__file__).resolve().parents[1])  # the code the demo runs
        path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        logs = Path(cfg.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        agent = _Agent(cmd, env, logs / f"agent-{len(self.agents)}.log")
        self.agents.append(agent)
        return agent

    def _stop_everything(self) -> None:
        """Kill whatever of the job still runs (agents, their workers, their helpers)."""
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.kill()
        for info in self.procs.values():
            with contextlib.suppress(OSError):
                if self.cfg.out.encode() in Path(f"/proc/{info.pid}/cmdline").read_bytes():
                    os.kill(info.pid, signal.SIGKILL)
        self.log.close()

    # messages and events ---------------------------------------------------------------------
    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "step":
            self.step, self.round = msg[1], msg[3]
        super().handle(msg)

    def hello(self, process: int, pid: int, incarnation: int, node: int, parent: int) -> None:
        first = len(self.procs) < NODES * NPROC
        self.procs[process] = _Process(pid, incarnation, node, parent, time.time())
        if first and len(self.procs) == NODES * NPROC:
            for n in range(NODES):
                mine = sorted(p for p, i in self.procs.items() if i.node == n)
                agent = self.procs[mine[0]].agent if mine else "?"
                workers = ", ".join(f"{p} (pid {self.procs[p].pid})" for p in mine)
                self.show.line(f"  node {n}: agent pid {agent}, worker processes {workers}")
        elif incarnation > 0 and process == self.victim and self.stage == "respawn":
            self.stage = "rejoin"
            after = time.time() - self.killed_at
            self.show.line(
                f"  > process {process} respawned by its agent: pid {pid}, incarnation "
                f"{incarnation}, {after:.2f} s after the kill; it joins as a spare"
            )
        elif self.replacement is not None and parent == self.replacement.pid:
            self.show.line(
                f"  > replacement node {node}: worker process {process} started, pid {pid}, "
                f"incarnation {incarnation}"
            )
            if self.stage == "replace" and all(self.procs[p].agent == parent for p in self.lost):
                self.stage = "admit"

    def describe(self, process: int) -> str:
        info = self.procs.get(process)
        name = "spare process" if process >= self.cfg.ranks else "process"
        if info is not None and info.incarnation > 0:
            return f"{name} {process} (pid {info.pid}, incarnation {info.incarnation})"
        return f"{name} {process}"

    def unplanned_round(self, rnd: int, first: int, source: str) -> None:
        if self.stage in ("kill node", "replace", "admit"):
            self.show.line(
                f"  > round {rnd}: new processes admitted (the job restarts at a round "
                f"boundary to take them in), resumed at step {first} from {source}"
            )
        else:
            super().unplanned_round(rnd, first, source)

    def on_event(self, event: dict[str, Any]) -> None:
        """An agent's or worker's event of the launcher (``launch_*``)."""
        kind = event.get("kind")
        if kind == "launch_node_lost":
            after = float(event["time"]) - self.killed_at
            self.show.line(
                f"    node {event.get('node')} declared lost by the agent of node "
                f"{-1 - int(event.get('rank') or -1)} {after:.2f} s after the kill "
                f"(ranks {event.get('ranks')})"
            )
        elif kind in ("launch_admitted", "join_wait"):
            process = self._process_of(event)
            if process is None:
                return
            if process == self.victim and self.stage == "rejoin":  # the node may go now
                self.stage = "kill node"
                _faults.release(self.cfg.out, self.node_step)
            if kind == "join_wait" and process not in self.waiting:
                self.waiting.add(process)
                self.show.line(
                    f"    {self.describe(process)} waits to be admitted at the next round boundary"
                )
            elif kind == "launch_admitted":
                self.admitted[process] = event
                self.show.line(
                    f"  > {self.describe(process)} admitted at round {event.get('round')} "
                    f"after waiting {float(event.get('waited') or 0.0):.2f} s"
                )
        elif kind == "launch_escalated":
            self.show.line(f"  ! whole-job restart asked: {event.get('reason')}")
        elif kind == "launch_generation" and int(event.get("generation") or 0) > 0:
            self.show.line(f"  > generation {event['generation']} started")

    def _process_of(self, event: dict[str, Any]) -> int | None:
        """The process (slot) whose worker wrote ``event``."""
        return next((p for p, i in self.procs.items() if i.pid == event.get("pid")), None)

    # the faults ------------------------------------------------------------------------------
    def _fault(self, kind: str, rank: int, text: str) -> None:
        """Record a fault the demo carried out on ``rank`` (-1: no active rank was hit)."""
        self.killed_at = time.time()
        self.show.line(text)
        fault = {"kind": kind, "step": self.step + 1, "rank": rank, "round": self.round}
        fault["time"] = self.killed_at
        self.injected.append(fault)
        self.log.set_context(round=self.round)
        self.log.emit("demo_fault", fault=kind, step=self.step + 1, target=rank)
        if rank >= 0:
            self.pending_fault = fault

    def _kill_worker(self) -> None:
        rank = self.cfg.ranks - 1
        process = self.holders.get(rank, rank)
        info = self.procs[process]
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGKILL)
        self.victim = process
        self.killed.add(process)
        self.stage = "respawn"  # the node's step waits for the respawned worker (module doc)
        _faults.hold(self.cfg.out, self.node_step)
        self._fault(
            "kill",
            rank,
            f"  ! SIGKILL worker process {process} (rank {rank}, pid {info.pid}) after step "
            f"{self.step + 1} (round {self.round})",
        )

    def _kill_node(self) -> None:
        members = sorted(p for p, i in self.procs.items() if i.node == LOST_NODE)
        pid = self.procs[members[0]].agent
        agent = next(a for a in self.agents if a.pid == pid)
        agent.lost = True
        doomed = agent.kill()
        for process in members:
            shutil.rmtree(self.cfg.local_root(process), ignore_errors=True)
        self.lost = set(members)
        self.killed.update(members)
        held = [r for r, p in self.holders.items() if p in self.lost]
        self.stage = "recover"
        self._fault(
            "node",
            min(held, default=-1),
            f"  ! node {LOST_NODE} lost: SIGKILL its agent (pid {pid}) and the {len(doomed)} "
            f"processes under it (worker processes {', '.join(map(str, members))}) after step "
            f"{self.step + 1}; its local checkpoints are deleted",
        )
        if not held:
            self.stage = "replace"

    def _hold(self) -> None:
        """Hold the job a few steps on until the replacement's workers wait to be admitted
        (on a busy machine they may start slower than the job trains)."""
        # rank 0 reports every report_every steps: it may be that far ahead already. Late
        # enough that the replacement is usually ready (no wait); halfway between two local
        # checkpoints (an exception just after a save waits for its replication to close:
        # up to the manager's timeout)
        every = self.cfg.local_every
        soon = max(self.step + 1 + 3 * self.cfg.report_every, 3 * self.cfg.steps // 4)
        self.hold_step = -(-soon // every) * every + every // 2
        if self.hold_step >= self.cfg.steps:
            self.hold_step = self.step + 1 + 3 * self.cfg.report_every
        if self.hold_step < self.cfg.steps:
            _faults.hold(self.cfg.out, self.hold_step)

    def _boundary(self) -> None:
        """The replacement's workers wait for a round boundary (the job runs at full size,
        so they do not end the round themselves): ask for an exception where the job is held,
        then let it go on."""
        self.stage = "boundary"
        fault = _faults.Fault(self.hold_step, 0, "exception")
        if fault.step >= self.cfg.steps:
            return
        _faults.request(self.cfg.out, fault)
        _faults.release(self.cfg.out, self.hold_step)
        self.show.line(
            f"  + the job runs at full size, so the replacement's workers wait for the next "
            f"round boundary: the demo asks for {fault.label}"
        )

    def _advance(self) -> None:
        """Carry out the next fault when its time has come."""
        if self.stage == "kill worker" and self.step + 1 >= self.worker_step:
            self._kill_worker()
        elif self.stage == "kill node" and self.step + 1 >= self.node_step:
            self._kill_node()
        elif self.stage == "recover" and self.pending_fault is None:
            self.stage = "replace"
        elif self.stage == "admit" and self.lost <= self.waiting:
            self._boundary()
        elif self.stage == "boundary" and self.lost <= set(self.admitted):
            self.stage = "done"
        if self.stage == "replace" and self.replacement is None:
            self.replacement = self._start_agent(host=False)
            self._hold()
            self.show.line(
                f"  + replacement node started: agent pid {self.replacement.pid}, same "
                f"rendezvous id ({self.run_id})"
            )

    # the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        channels = JsonlTail(Path(self.cfg.out) / "channels", "process-*.jsonl")
        found = JsonlTail(Path(self.cfg.out) / "events", "events-*.jsonl")
        self.started = time.time()
        deadline = time.monotonic() + self.timeout
        try:
            for node in range(NODES):
                self._start_agent(host=node == 0)
            while True:
                ended = all(a.lost or a.proc.poll() is not None for a in self.agents)
                for msg in channels.poll():
                    self.handle(tuple(msg))
                for event in found.poll():
                    if isinstance(event, dict) and event.get("kind") in _SHOWN:
                        self.on_event(event)
                if ended:
                    break
                if time.monotonic() > deadline:
                    self.errors.append(f"the run did not finish within {self.timeout:.0f} s")
                    break
                self._advance()
                time.sleep(0.05)
        finally:
            self._stop_everything()
        self._check()
        return self.verdict()

    def _check(self) -> None:
        """Errors for agents that failed and for faults that did not happen."""
        for agent in self.agents:
            code = agent.proc.returncode
            if not agent.lost and code != 0:
                self.errors.append(f"agent pid {agent.pid} exited with {code} (see {agent.log})")
        if self.stage != "done":
            self.errors.append(
                f"the job ended before the demo's faults were all carried out (at stage "
                f"{self.stage!r}); give more --steps or a longer --step-time"
            )
