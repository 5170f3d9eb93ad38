"""``trainguard demo``: start the ranks, show progress, faults and recoveries, judge the result.

The parent process starts ``ranks + spares`` processes (:mod:`trainguard.demo.worker`), each
with its own one-way pipe, and waits on the pipes and the processes together. It prints a
progress line (redrawn in place on a terminal), one line per injected fault and per recovery,
then the goodput report of the run's event log (:mod:`trainguard.report`) and the verdict of
the bit-identical check. Exit status: 0 when the guarded run's parameters equal the fault-free
reference's bit for bit on every rank, 1 when they do not, 2 when the run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from trainguard.demo import faults as _faults
from trainguard.demo.worker import DemoConfig
from trainguard.errors import ConfigError


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
        elif kind == "fault":
            _, fkind, step, rank, process, rnd, t = msg
            if fkind == "kill":
                self.killed.add(process)
            fault = {"kind": fkind, "step": step, "rank": rank, "round": rnd, "time": t}
            self.injected.append(fault)
            self.pending_fault = fault
            self.show.line(f"  ! injected {fkind} on rank {rank} before step {step} (round {rnd})")
        elif kind == "resumed":
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
                self.recoveries.append({**fault, "resumed_round": rnd, "recovery_s": took})
                self.show.line(
                    f"  > round {rnd}: {world} ranks training again {took:.2f} s after the "
                    f"fault, resumed at step {first} from {source}"
                )
        elif kind == "done":
            _, rank, process, digest, _rnd, t = msg
            self.done[rank] = (digest, process)
            self.guard_end = max(self.guard_end or t, t)
        elif kind == "idle":
            self.idle.add(msg[1])
        elif kind == "error":
            _, process, text = msg
            self.errors.append(f"process {process}: {text}")
            self.show.line(f"  process {process} failed: {text}")

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
            if proc.exitcode != 0 and process not in self.killed:
                self.errors.append(f"process {process} exited with status {proc.exitcode}")
        return self.verdict()

    def verdict(self) -> int:
        cfg, show = self.cfg, self.show
        missing = sorted(set(range(cfg.ranks)) - set(self.done))
        if missing or self.errors or len(self.reference) != cfg.ranks:
            for error in self.errors:
                show.line(f"error: {error}")
            if missing:
                show.line(f"error: ranks {missing} did not finish")
            show.line(f"run directory: {cfg.out}")
            return 2
        wall = (self.guard_end or time.time()) - (self.guard_start or self.started)
        show.line(
            f"guarded run finished: {cfg.steps} steps, {len(self.injected)} faults, "
            f"{len(self.recoveries)} recoveries, {wall:.1f} s"
        )
        _write_report(cfg.out, show)
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


def _write_report(out: str, show: _Display) -> None:
    """Print the goodput report; write report.txt, report.json and timeline.png into ``out``."""
    import json

    from trainguard import events, report

    merged = events.read_events(Path(out) / "events")
    rep = report.analyze(merged)
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small model through injected faults and check nothing was lost",
        description=(
            "Start RANKS training processes and SPARES spares on this machine (CPU, gloo), "
            "train a small model for STEPS steps under the in-process restart wrapper with "
            "local (replicated) and asynchronous disk checkpoints, inject the scheduled faults, "
            "then check that the final parameters are bit-identical to a fault-free run of the "
            "same training. Exit status 0: identical; 1: not identical; 2: the run failed."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "fault kinds (KIND@STEP:RANK, comma-separated):\n"
            "  exception  the rank raises an Exception\n"
            "  hang       the rank blocks in a GIL-releasing sleep (found after --soft-timeout)\n"
            "  kill       the rank's process is SIGKILLed (a spare takes its rank number)\n"
            "  lostdir    the rank's local checkpoint directory is deleted and the rank raises\n"
            "             (its part is recovered from a replica on a peer)\n"
            f"default: {_faults.DEFAULT_SCHEDULE}"
        ),
    )
    p.add_argument("--ranks", type=int, help="active training ranks (default 4; --launch: 2)")
    p.add_argument("--spares", type=int, help="spare processes (default 1; --launch: 2)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument(
        "--faults",
        help=f"fault schedule KIND@STEP:RANK,... (default: {_faults.DEFAULT_SCHEDULE}; "
        "--launch: none)",
    )
    p.add_argument("--no-faults", action="store_true", help="inject nothing")
    p.add_argument("--out", help="run directory (default: a new directory under the temp dir)")
    p.add_argument(
        "--local-every", type=int, default=10, help="local checkpoint every N steps (10)"
    )
    p.add_argument("--disk-every", type=int, default=50, help="disk checkpoint every N steps (50)")
    p.add_argument(
        "--soft-timeout",
        type=float,
        help="seconds without progress = hang (default 3; --launch: 10, for the start-up of "
        "new processes on a busy machine)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds (600)"
    )
    p.add_argument(
        "--launch",
        action="store_true",
        help="run the job under `trainguard launch` as 2 nodes x 2 workers (2 ranks + 2 "
        "spares); SIGKILL one worker after a fifth of the steps (its agent respawns it), then "
        "a whole node (agent and workers) after two fifths, and start a replacement node",
    )
    p.add_argument(
        "--step-time",
        type=float,
        help="each step lasts at least this many seconds (default 0; --launch: 0.1, so that "
        "respawned processes and the replacement node start while the job trains)",
    )
    p.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=command)


def _shape(args: argparse.Namespace) -> tuple[int, int, float]:
    """Ranks, spares and step time of the run (``--launch`` fixes the first two)."""
    if not args.launch:
        step_time = 0.0 if args.step_time is None else args.step_time
        return (
            (4 if args.ranks is None else args.ranks),
            (1 if args.spares is None else args.spares),
            step_time,
        )
    from trainguard.demo._launch import NODES, NPROC, RANKS

    ranks = RANKS if args.ranks is None else args.ranks
    spares = NODES * NPROC - RANKS if args.spares is None else args.spares
    if (ranks, spares) != (RANKS, NODES * NPROC - RANKS):
        raise ConfigError(
            f"--launch runs {NODES} nodes x {NPROC} workers as {RANKS} ranks + "
            f"{NODES * NPROC - RANKS} spares (a lost node leaves enough); drop --ranks/--spares"
        )
    return ranks, spares, 0.1 if args.step_time is None else args.step_time


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    ranks, spares, step_time = _shape(args)
    args.ranks, args.spares = ranks, spares
    if args.soft_timeout is None:
        args.soft_timeout = 10.0 if args.launch else 3.0
    if args.ranks < 2:
        raise ConfigError(f"--ranks {args.ranks}: the demo needs at least 2 ranks")
    if args.spares < 0:
        raise ConfigError("--spares must be 0 or more")
    if args.steps < 2:
        raise ConfigError("--steps must be at least 2")
    if args.local_every < 1 or args.disk_every < 1:
        raise ConfigError("--local-every and --disk-every must be at least 1")
    if args.soft_timeout <= 0:
        raise ConfigError("--soft-timeout must be positive seconds")
    if step_time < 0:
        raise ConfigError("--step-time must be 0 or more seconds")
    default = "" if args.launch else _faults.DEFAULT_SCHEDULE
    schedule = "" if args.no_faults else (default if args.faults is None else args.faults)
    found = _faults.parse(schedule, ranks=args.ranks, spares=args.spares, steps=args.steps)
    out = args.out or tempfile.mkdtemp(prefix="trainguard-demo-")
    os.makedirs(out, exist_ok=True)
    if any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} is not empty; give a new or empty directory")
    return DemoConfig(
        out=str(Path(out).resolve()),
        ranks=args.ranks,
        spares=args.spares,
        steps=args.steps,
        faults=found,
        local_every=args.local_every,
        disk_every=args.disk_every,
        soft_timeout=args.soft_timeout,
        hard_timeout=max(10.0, 3 * args.soft_timeout),
        perturb=args.perturb,
        step_time=step_time,
    )


def command(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"trainguard demo: {exc}", file=sys.stderr)
        return 2
    where = " under trainguard launch (2 nodes x 2 workers)" if args.launch else ""
    print(
        f"trainguard demo{where}: {cfg.ranks} ranks + {cfg.spares} spare(s), {cfg.steps} steps, "
        f"local checkpoint every {cfg.local_every} steps (replicated), disk every "
        f"{cfg.disk_every}; faults: {', '.join(f.label for f in cfg.faults) or 'none'}"
    )
    print(f"run directory: {cfg.out}", flush=True)
    if args.launch:
        from trainguard.demo._launch import LaunchRun

        return LaunchRun(cfg, sys.stdout, args.timeout, inject=not args.no_faults).run()
    return _Run(cfg, sys.stdout, args.timeout).run()
