"""The demo's run: start the processes, show progress, faults and recoveries, judge the result.

:class:`_Run` starts ``ranks + spares`` processes (:mod:`trainguard.demo.worker`), each with its
own one-way pipe, and handles their messages; :class:`trainguard.demo._launch.LaunchRun` runs the
same job under ``trainguard launch`` with the same handler. :mod:`trainguard.demo.runner` is the
command line.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from trainguard.demo import faults as _faults
from trainguard.demo.worker import DemoConfig
from trainguard.restart.preempt import EXIT_PREEMPTED


def injected_line(kind: str, rank: int, step: int, rnd: int) -> str:
    """The line of an injected fault. This and the next two are the lines the README and
    docs/demo.md quote (tests/demo/test_demo_docs.py checks the quotes against them)."""
    return f"  ! injected {kind} on rank {rank} before step {step} (round {rnd})"


def recovery_line(rnd: int, world: int, took: float, first: int, source: str, lost: int) -> str:
    """The line of a recovery: round ``rnd`` trains again ``took`` s after the fault."""
    return (
        f"  > round {rnd}: {world} ranks training again {took:.2f} s after the fault, resumed "
        f"at step {first} from {source}, {lost} steps recomputed"
    )


def finished_line(steps: int, faults: int, recoveries: int, recomputed: int, wall: float) -> str:
    """The line at the end of the guarded run."""
    return (
        f"guarded run finished: {steps} steps, {faults} faults, {recoveries} recoveries, "
        f"{recomputed} steps recomputed, {wall:.1f} s"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Display:
    """Progress line and event lines; redraws in place only on a terminal."""

    def __init__(self, cfg: DemoConfig, stream: TextIO) -> None:
        self.cfg = cfg
        self.out = stream
        self.tty = stream.isatty()
        self.drawn = False
        self.last_plain = -1

    def line(self, text: str) -> None:
        if self.drawn:
            self.out.write("\r\033[K")
            self.drawn = False
        self.out.write(text + "\n")
        self.out.flush()

    def progress(self, step: int, loss: float, rnd: int, world: int) -> None:
        done = step + 1
        width = 30
        fill = int(width * done / self.cfg.steps)
        text = (
            f"  [{'#' * fill}{'.' * (width - fill)}] step {done:>4}/{self.cfg.steps}"
            f"  loss {loss:6.4f}  round {rnd}  active ranks {world}"
        )
        if self.tty:
            self.out.write("\r\033[K" + text)
            self.out.flush()
            self.drawn = True
        elif done // 50 != self.last_plain // 50 or done == self.cfg.steps:
            self.last_plain = done
            self.line(text)


class _Run:
    def __init__(self, cfg: DemoConfig, stream: TextIO, timeout: float) -> None:
        self.cfg = cfg
        self.show = _Display(cfg, stream)
        self.timeout = timeout
        self.reference: dict[int, str] = {}
        self.ref_time = 0.0
        self.done: dict[int, tuple[str, int]] = {}  # rank -> (digest, process)
        self.errors: list[str] = []
        self.injected: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.killed: set[int] = set()
        self.idle: set[int] = set()
        self.holders: dict[int, int] = {}  # rank -> the process that resumed it last
        self.last_round = -1
        self.pending_fault: dict[str, Any] | None = None
        self.started = 0.0
        self.guard_start: float | None = None
        self.guard_end: float | None = None
        self.stopped_at: dict[int, int] = {}  # preempted: rank -> the step it saved
        self.stopped: set[int] = set()  # processes that exited preempted (status 75)
        if cfg.resumed:
            self.reference = {int(k): v for k, v in _load_reference(cfg.out).items()}

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "hello":
            _, process, pid, incarnation, node, parent = msg
            self.hello(process, pid, incarnation, node, parent)
        elif kind == "reference":
            _, process, digest, seconds = msg
            self.reference[process] = digest
            self.ref_time = max(self.ref_time, seconds)
            if len(self.reference) == self.cfg.ranks:
                _save_reference(self.cfg.out, self.reference)
                same = len(set(self.reference.values())) == 1
                self.show.line(
                    f"reference run without faults: {self.cfg.steps} steps on {self.cfg.ranks} "
                    f"ranks in {self.ref_time:.1f} s, parameters {digest[:16]}"
                    + ("" if same else " (ranks disagree!)")
                )
                self.show.line("guarded run:")
        elif kind == "step":
            _, step, loss, rnd, world, _t = msg
            self.show.progress(step, loss, rnd, world)
        elif kind == "fault" and msg[1] == "preempt":
            _, fkind, step, rank, process, rnd, t = msg
            self.injected.append({"kind": fkind, "step": step, "rank": rank, "round": rnd})
            pids = _faults.sigterm_job(os.getpid())
            self.show.line(
                f"  ! preemption before step {step}: SIGTERM to every process of the job "
                f"({len(pids)} processes)"
            )
        elif kind == "fault":
            _, fkind, step, rank, process, rnd, t = msg
            if fkind == "kill":
                self.killed.add(process)
            fault = {"kind": fkind, "step": step, "rank": rank, "round": rnd, "time": t}
            self.injected.append(fault)
            self.pending_fault = fault
            self.show.line(injected_line(fkind, rank, step, rnd))
        elif kind == "resumed":
            self.resumed(msg)
        elif kind == "preempted":
            _, rank, process, step, _t = msg
            self.stopped_at[rank] = step
        elif kind == "stopped":
            self.stopped.add(msg[1])
        elif kind == "done":
            _, rank, process, digest, _rnd, t = msg
            self.done[rank] = (digest, process)
            self.guard_end = max(self.guard_end or t, t)
        elif kind == "idle":
            self.idle.add(msg[1])
        elif kind == "straggler":  # taken out by the straggler policy; a spare takes over
            self.killed.add(msg[1])
            self.show.line(f"  process {msg[1]} left the job: {msg[2].splitlines()[0]}")
        elif kind == "error":
            _, process, text = msg
            self.errors.append(f"process {process}: {text}")
            self.show.line(f"  process {process} failed: {text}")

    def resumed(self, msg: tuple[Any, ...]) -> None:
        """A rank is training again in round ``rnd`` from step ``first``: who took over, and
        (rank 0) how long the pending fault's recovery took and how many steps it recomputed."""
        _, rnd, rank, process, first, source, origin, world, t, init_s = msg
        if self.guard_start is None:
            self.guard_start = t - init_s
        if origin is not None and not origin.startswith("local"):
            self.show.line(
                f"    rank {rank} (process {process}) lost its copy: got its part from {origin}"
            )
        before, self.holders[rank] = self.holders.get(rank, process), process
        if before != process:
            self.show.line(f"    {self.describe(process)} took over rank {rank}")
        if rank == 0 and self.pending_fault is None and rnd > self.last_round >= 0:
            self.unplanned_round(rnd, first, source)
        if rank == 0:
            self.last_round = rnd
        if rank == 0 and self.pending_fault is not None:
            fault, self.pending_fault = self.pending_fault, None
            took = t - fault["time"]
            lost = max(0, fault["step"] - first)  # steps done before the fault, run again
            self.recoveries.append(
                {**fault, "resumed_round": rnd, "recovery_s": took, "recomputed": lost}
            )
            self.show.line(recovery_line(rnd, world, took, first, source, lost))

    def hello(self, process: int, pid: int, incarnation: int, node: int, parent: int) -> None:
        """Process ``process`` started (pid ``pid``, its launcher's ``incarnation``, on
        ``node``, child of ``parent``); the demo's own processes need nothing more."""

    def describe(self, process: int) -> str:
        """How the output names ``process``."""
        return f"{'spare ' if process >= self.cfg.ranks else ''}process {process}"

    def unplanned_round(self, rnd: int, first: int, source: str) -> None:
        """Rank 0 entered round ``rnd`` with no fault injected since the last round."""
        self.show.line(
            f"  > round {rnd}: restarted without an injected fault (a slow step taken "
            f"for a hang? see the report), resumed at step {first} from {source}"
        )

    def run(self) -> int:
        cfg = self.cfg
        ctx = multiprocessing.get_context("spawn")
        from trainguard.demo.worker import main as worker_main

        job_port, ref_port = _free_port(), _free_port()
        conns, procs = [], []
        self.started = time.time()
        for process in range(cfg.world):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                args=(cfg, process, job_port, ref_port, send),
                name=f"trainguard-demo-{process}",
            )
            proc.start()
            send.close()
            conns.append(recv)
            procs.append(proc)
        deadline = time.monotonic() + self.timeout
        live = list(conns)
        try:
            while live or any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    self.errors.append(f"the run did not finish within {self.timeout:.0f} s")
                    break
                ready = multiprocessing.connection.wait(
                    live + [p.sentinel for p in procs if p.is_alive()], timeout=0.5
                )
                for conn in ready:
                    if conn not in live:
                        continue
                    try:
                        self.handle(conn.recv())
                    except EOFError:
                        live.remove(conn)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            for conn in conns:
                conn.close()
        for process, proc in enumerate(procs):
            preempted = proc.exitcode == EXIT_PREEMPTED and process in self.stopped
            if proc.exitcode != 0 and process not in self.killed and not preempted:
                self.errors.append(f"process {process} exited with status {proc.exitcode}")
        return self.verdict()

    def verdict(self) -> int:
        cfg, show = self.cfg, self.show
        if self.stopped and not self.errors:
            return self.preempted()
        missing = sorted(set(range(cfg.ranks)) - set(self.done))
        if missing or self.errors or len(self.reference) != cfg.ranks:
            for error in self.errors:
                show.line(f"error: {error}")
            if missing:
                show.line(f"error: ranks {missing} did not finish")
            show.line(f"run directory: {cfg.out}")
            return 2
        wall = (self.guard_end or time.time()) - (self.guard_start or self.started)
        recomputed = sum(r["recomputed"] for r in self.recoveries)
        show.line(
            finished_line(cfg.steps, len(self.injected), len(self.recoveries), recomputed, wall)
        )
        _write_report(cfg.out, show, cfg.events_dir)
        ref = next(iter(self.reference.values()))
        got = {rank: d for rank, (d, _) in sorted(self.done.items())}
        ok = len(set(self.reference.values())) == 1 and all(d == ref for d in got.values())
        if ok:
            show.line(
                f"bit-identical: yes - every rank's parameters equal the fault-free run's "
                f"(sha256 {ref[:16]})"
            )
        else:
            show.line("bit-identical: NO - the guarded run's parameters differ from the reference:")
            show.line(f"  reference sha256 {ref}")
            for rank, digest in got.items():
                show.line(f"  rank {rank}    sha256 {digest}")
        show.line(f"run directory: {cfg.out}  (trainguard report {cfg.out})")
        return 0 if ok else 1

    def preempted(self) -> int:
        """The run was preempted: every rank saved one agreed step (75), or it failed (2)."""
        cfg, show = self.cfg, self.show
        steps = set(self.stopped_at.values())
        if sorted(self.stopped_at) != list(range(cfg.ranks)) or len(steps) != 1:
            show.line(f"error: preempted, but the ranks saved steps {self.stopped_at}")
            return 2
        (step,) = steps
        show.line(
            f"preempted: every rank stopped at step {step} and saved it (local and disk "
            f"checkpoints); exit status {EXIT_PREEMPTED}"
        )
        show.line(f"continue the run: trainguard demo --resume {cfg.out}")
        return EXIT_PREEMPTED


def _save_reference(out: str, reference: dict[int, str]) -> None:
    """Keep the fault-free run's digests, for the check at the end of a resumed run."""
    import json

    Path(out, "reference.json").write_text(json.dumps(reference) + "\n")


def _load_reference(out: str) -> dict[str, str]:
    import json

    found = json.loads(Path(out, "reference.json").read_text())
    if not isinstance(found, dict):
        raise ValueError(f"{out}/reference.json is not a mapping")
    return found


def _write_report(out: str, show: _Display, directory: Path) -> None:
    """Print the goodput report; write report.txt, report.json and timeline.png into ``out``."""
    import json

    from trainguard import events, report
    from trainguard.report._reinit import recovery_line

    merged = events.read_events(directory)
    rep = report.analyze(merged)
    lines = [recovery_line(i, f) for i, f in enumerate(rep.faults, 1)]
    if any(lines):
        show.line("recoveries (fault -> every active rank finished a step of the new round):")
        for line in filter(None, lines):
            show.line(line)
    table = report.format_table(rep)
    show.line(table)
    Path(out, "report.txt").write_text(table + "\n")
    Path(out, "report.json").write_text(json.dumps(rep.to_dict(), indent=1) + "\n")
    try:
        from trainguard.report._plot import plot_timeline

        plot_timeline(merged, rep, Path(out) / "timeline.png")
        show.line(f"timeline: {Path(out) / 'timeline.png'}")
    except ImportError as exc:
        show.line(f"timeline: skipped ({exc})")
