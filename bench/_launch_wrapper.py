"""The Wrapper rows of bench/launch.py: gloo + in-process restart under both launchers.

Each scenario starts one job of ``tests/launch/_workers.py wrapper`` (a ``Wrapper`` job with
``FillGaps`` + ``MaxActiveWorldSize(active)``; every step appends ``{rank, initial, pid, round,
world, time}`` to ``OUT/steps.jsonl``), with ``OUT/hold`` present so that a round never ends on
its own, makes one fault, reads the step records, and kills the job (the tests check that these
jobs also finish cleanly). Times are wall-clock on this machine: the worker's ``time.time()`` of
a step minus the bench's ``time.time()`` just before the fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.launch._agents import Agents, leftovers, read_starts

from trainguard import events

STEP = 0.02
VICTIM = 1  # the initial rank killed: active in round 0, not rank 0
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 2.0
NODE_OPTIONS = [
    f"--tg-heartbeat-interval={HEARTBEAT_INTERVAL}",
    f"--tg-heartbeat-timeout={HEARTBEAT_TIMEOUT}",
]
#: all 4 ranks active, so that the lost node holds active ranks (with 2, FillGaps puts both
#: active ranks on node 0 and the lost node holds only spares)
NODE_ACTIVE = 4
Record = dict[str, Any]


def _records(path: Path) -> list[Record]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(out: Path) -> list[Record]:
    return _records(out / "steps.jsonl")


def _events(ev: Path, kind: str) -> list[Record]:
    return [e for e in events.read_events(ev) if e["kind"] == kind] if ev.exists() else []


def helpers(run_id: str, out: Path, nodes: int) -> dict[str, float]:
    """The job's processes that are not workers, per node, by kind (from their command line)."""
    workers = {s["pid"] for s in read_starts(out)}
    kinds: dict[str, float] = {}
    for pid in leftovers(run_id):
        if pid in workers:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"restart.sidecar" in cmdline:
            kind = "sidecar"
        elif b"coord._server" in cmdline:
            kind = "store"
        elif b"trainguard.launch" in cmdline or b"torch.distributed.run" in cmdline:
            kind = "agent"
        else:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0.0) + 1.0 / nodes
    return kinds


def _first_steps(records: list[Record], keep: Callable[[Record], bool]) -> dict[int, float]:
    """The time of the first kept record of each rank (the rank of the round)."""
    first: dict[int, float] = {}
    for r in records:
        if keep(r) and r["rank"] not in first:
            first[r["rank"]] = r["time"]
    return first


class Job:
    """One Wrapper job (``Agents`` with the ``wrapper`` worker and ``OUT/hold`` present)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        module: str = "trainguard.launch",
        nodes: int = 1,
        nproc: int = 3,
        active: int = 2,
        extra: tuple[str, ...] = (),
        worker: tuple[str, ...] = (),
    ) -> None:
        self.out, self.ev = tmp / name / "out", tmp / name / "events"
        self.out.mkdir(parents=True)
        (self.out / "hold").touch()
        options = [f"--tg-events-dir={self.ev}"] if module == "trainguard.launch" else []
        self.nodes = nodes
        self.agents = Agents(
            tmp / name,
            nodes=nodes,
            nproc=nproc,
            module=module,
            worker=["wrapper", str(self.out), f"--active={active}", "--steps=5",
                    f"--step={STEP}", *worker],
            extra=["--max-restarts=1", *options, *extra],
            env={"TRAINGUARD_EVENTS_DIR": str(self.ev)},
            timeout=120,
        )  # fmt: skip

    def steps(self) -> list[Record]:
        return _steps(self.out)

    def running(self, active: int, *, timeout: float = 90) -> list[Record]:
        """Wait until ``active`` ranks made 3 steps in one round; the start records."""

        def ready() -> bool:
            done = [s for s in self.steps() if s["step"] >= 3]
            return len({(s["round"], s["rank"]) for s in done}) >= active

        self.agents.wait_for(ready, timeout=timeout, what=f"{active} ranks stepping")
        return read_starts(self.out)

    def pid(self, initial: int) -> int:
        return int(next(s["pid"] for s in read_starts(self.out) if s["rank"] == initial))

    def wait_for(self, cond: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        return self.agents.wait_for(cond, timeout=timeout, what=what)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.agents.kill()


def next_round(job: Job, t_kill: float, dead: set[int], active: int) -> float:
    """Kill -> the first step of the next round on every active rank (none of them ``dead``)."""
    before = max(s["round"] for s in job.steps() if s["time"] <= t_kill)

    def back() -> dict[int, float] | None:
        later = [s for s in job.steps() if s["round"] > before and s["pid"] not in dead]
        if not later:
            return None
        rnd = min(s["round"] for s in later)
        first = _first_steps(later, lambda s: s["round"] == rnd)
        return first if len(first) >= active else None

    first: dict[int, float] = job.wait_for(back, "the next round on every active rank")
    return max(first.values()) - t_kill


def spare(tmp: Path) -> dict[str, Any]:
    """1 node x 3 workers, 2 active: SIGKILL active rank 1 -> the survivor and the spare step."""
    with Job(tmp, "spare") as job:
        job.running(2)
        found = helpers(job.agents.run_id, job.out, 1)
        victim = job.pid(VICTIM)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        back = next_round(job, t_kill, {victim}, 2)
        return {"survivors_back_s": back, "helpers": found}


def torchrun(tmp: Path) -> dict[str, Any]:
    """The same job under torchrun: SIGKILL rank 1 -> both active ranks of the restarted
    attempt (new processes) stepping."""
    with Job(tmp, "torchrun", module="torch.distributed.run") as job:
        job.running(2)
        found = helpers(job.agents.run_id, job.out, 1)
        t_kill = time.time()
        os.kill(job.pid(VICTIM), signal.SIGKILL)

        def back() -> dict[int, float] | None:
            fresh = {s["pid"] for s in read_starts(job.out) if s["time"] > t_kill}
            first = _first_steps(job.steps(), lambda s: s["pid"] in fresh)
            return first if len(first) >= 2 else None

        first = job.wait_for(back, "the restarted attempt stepping", timeout=90)
        started = max(s["time"] for s in read_starts(job.out) if s["time"] > t_kill)
        return {
            "all_back_s": max(first.values()) - t_kill,
            "started_s": started - t_kill,
            "helpers": found,
        }


def respawn(tmp: Path) -> dict[str, Any]:
    """1 node x 2 workers, 2 active, no spare: SIGKILL rank 1 -> the respawned process starts
    (its start record); -> its start-up is done (torch and trainguard imported, about to call
    the Wrapper); -> the first step of the first round with world 2 that includes it, on both
    ranks."""
    with Job(tmp, "respawn", nproc=2) as job:
        job.running(2)
        victim = job.pid(VICTIM)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def new_pid() -> int | None:
            return next((s["pid"] for s in read_starts(job.out) if s["incarnation"] == "1"), None)

        def admitted() -> dict[int, float] | None:
            pid = new_pid()
            full = [s for s in job.steps() if s["world"] == 2 and s["time"] > t_kill]
            rounds = [s["round"] for s in full if s["pid"] == pid]
            if pid is None or not rounds:
                return None
            first = _first_steps(full, lambda s: s["round"] == min(rounds))
            return first if len(first) >= 2 else None

        first = job.wait_for(admitted, "the world back to 2 with the respawned worker")
        pid = new_pid()
        started = next(s["time"] for s in read_starts(job.out) if s["pid"] == pid)
        ready = next(s["time"] for s in _records(job.out / "ready.jsonl") if s["pid"] == pid)
        return {
            "respawn_started_s": started - t_kill,
            "respawn_ready_s": ready - t_kill,
            "admitted_s": max(first.values()) - t_kill,
        }


def node(tmp: Path) -> dict[str, Any]:
    """2 nodes x 2 workers (heartbeat 0.2 s, timeout 2 s): SIGKILL node 1's agent (its process
    group) and its 2 workers (sessions of their own) -> every surviving active rank of the next
    round stepping; -> the ``launch_node_lost`` event."""
    with Job(tmp, "node", nodes=2, nproc=2, active=NODE_ACTIVE, extra=tuple(NODE_OPTIONS)) as job:
        job.running(NODE_ACTIVE)
        pids = {s["rank"]: s["pid"] for s in read_starts(job.out)}
        t_kill = time.time()
        os.killpg(job.agents.procs[1].pid, signal.SIGKILL)
        for rank in (2, 3):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pids[rank], signal.SIGKILL)
        back = next_round(job, t_kill, {pids[2], pids[3]}, min(NODE_ACTIVE, 2))
        (lost,) = job.wait_for(lambda: _events(job.ev, "launch_node_lost"), "launch_node_lost")
        return {"survivors_back_s": back, "detected_s": lost["time"] - t_kill}


def escalation(tmp: Path) -> dict[str, Any]:
    """1 node x 3 workers, 2 active, generation 0 fails every round: the Wrapper gives up and
    asks for a whole-job restart (``launch_escalated``) -> both active ranks of generation 1
    stepping."""
    with Job(tmp, "escalation", worker=("--raise-gen=0",)) as job:
        job.running(2, timeout=50)  # ~15 s when it works; a failed run costs no more
        (escalated, *_) = _events(job.ev, "launch_escalated")
        gen1 = {s["pid"] for s in read_starts(job.out) if s["generation"] == "1"}
        first = _first_steps(job.steps(), lambda s: s["pid"] in gen1)
        started = max(s["time"] for s in read_starts(job.out) if s["pid"] in gen1)
        return {
            "all_back_s": max(first.values()) - escalated["time"],
            "started_s": started - escalated["time"],
        }
