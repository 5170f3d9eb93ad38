"""``trainguard demo``: the command line (flags, the run's configuration).

The run itself (processes, progress, faults and recoveries, the report and the bit-identical
verdict) is :mod:`trainguard.demo._run`, or :mod:`trainguard.demo._launch` under ``--launch``.
Exit status: 0 when the guarded run's parameters equal the fault-free reference's bit for bit
on every rank, 1 when they do not, 2 when the run failed, 75 when a ``preempt`` fault stopped it
(every rank saved one agreed step; ``--resume DIR`` continues it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.demo import faults as _faults
from trainguard.demo._run import _Run
from trainguard.demo.worker import DemoConfig
from trainguard.errors import ConfigError

#: ``trainguard demo --help``: the fault kinds
_KINDS_HELP = (
    "fault kinds (KIND@STEP:RANK, comma-separated):\n"
    "  exception  the rank raises an Exception\n"
    "  hang       the rank blocks in a GIL-releasing sleep (found after --soft-timeout)\n"
    "  kill       the rank's process is SIGKILLed (a spare takes its rank number)\n"
    "  lostdir    the rank's local checkpoint directory is deleted and the rank raises\n"
    "             (its part is recovered from a replica on a peer)\n"
    f"  slow       the rank sleeps {_faults.SLOW_S:g} s more in every step from then on (a\n"
    "             straggler: reported; --take-out-stragglers replaces it with a spare)\n"
    "  preempt    SIGTERM to every process of the job: each rank stops at one agreed\n"
    "             step and saves it; exit status 75; continue with --resume DIR\n"
    f"default: {_faults.DEFAULT_SCHEDULE}"
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small model through injected faults and check nothing was lost",
        description=(
            "Start RANKS training processes and SPARES spares on this machine (CPU, gloo), "
            "train a small model for STEPS steps under the in-process restart wrapper with "
            "local (replicated) and asynchronous disk checkpoints, inject the scheduled faults, "
            "then check that the final parameters are bit-identical to a fault-free run of the "
            "same training. Exit status 0: identical; 1: not identical; 2: the run failed; "
            "75: preempted (a `preempt` fault), continue with --resume."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_KINDS_HELP,
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
    p.add_argument(
        "--take-out-stragglers",
        action="store_true",
        help="a rank that stays much slower than the others (a `slow` fault) leaves the job "
        "and a spare takes its number (default: stragglers are only reported)",
    )
    p.add_argument(
        "--model-mib",
        type=int,
        help="pad the model's checkpointed state to about this many MiB per rank, to see "
        "checkpoints and recovery at a realistic size (default 0, or TRAINGUARD_DEMO_MODEL_MIB: "
        "the small model alone; memory: about 3-4x this per rank, for the model, staging and "
        "restore buffers)",
    )
    p.add_argument(
        "--no-live",
        action="store_true",
        help="recover from checkpoints only (default: the survivors' live state first)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the preempted run in DIR (a `preempt` fault ended it) from the step it "
        "saved, with its settings, and check the end against its fault-free run",
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
    if args.model_mib is None:
        from trainguard import _env

        args.model_mib = _env.settings().demo_model_mib
    if args.model_mib < 0:
        raise ConfigError("--model-mib must be 0 (no padding) or more MiB")
    default = "" if args.launch else _faults.DEFAULT_SCHEDULE
    schedule = "" if args.no_faults else (default if args.faults is None else args.faults)
    found = _faults.parse(schedule, ranks=args.ranks, spares=args.spares, steps=args.steps)
    if args.launch and any(f.kind in _faults.ENDING for f in found):
        raise ConfigError("--faults preempt@...: run it without --launch")
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
        take_out_stragglers=args.take_out_stragglers,
        live=not args.no_live,
    )


def resume_config(args: argparse.Namespace) -> DemoConfig:
    """The configuration of the preempted run in ``--resume DIR``, to continue it."""
    path = Path(args.resume) / "demo.json"
    if args.launch:
        raise ConfigError("--resume continues a run made without --launch; drop --launch")
    try:
        saved = json.loads(path.read_text())
        cfg = DemoConfig.from_json(saved["config"])
        args.model_mib = int(saved["model_mib"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--resume {args.resume}: no demo run there ({exc}); give the run directory that "
            "a preempted `trainguard demo` printed"
        ) from None
    return dataclasses.replace(cfg, resumed=True)


def command(args: argparse.Namespace) -> int:
    try:
        cfg = resume_config(args) if args.resume else config_from_args(args)
    except ConfigError as exc:
        print(f"trainguard demo: {exc}", file=sys.stderr)
        return 2
    if not cfg.resumed:
        saved = {"config": cfg.to_json(), "model_mib": args.model_mib}
        Path(cfg.out, "demo.json").write_text(json.dumps(saved) + "\n")
    where = " under trainguard launch (2 nodes x 2 workers)" if args.launch else ""
    size = f", model state ~{args.model_mib} MiB per rank" if args.model_mib else ""
    recovery = "live state first" if cfg.live else "checkpoints only (--no-live)"
    print(
        f"trainguard demo{where}: {cfg.ranks} ranks + {cfg.spares} spare(s), {cfg.steps} steps"
        f"{size}, local checkpoint every {cfg.local_every} steps (replicated), disk every "
        f"{cfg.disk_every}; recovery from {recovery}; faults: "
        f"{', '.join(f.label for f in cfg.faults) or 'none'}"
    )
    print(f"run directory: {cfg.out}", flush=True)
    if cfg.resumed:
        print("resuming the preempted run from its newest checkpoint:", flush=True)
    with _model_size(args.model_mib):  # every process the run starts inherits it
        if args.launch:
            from trainguard.demo._launch import LaunchRun

            return LaunchRun(cfg, sys.stdout, args.timeout, inject=not args.no_faults).run()
        return _Run(cfg, sys.stdout, args.timeout).run()


@contextlib.contextmanager
def _model_size(mib: int) -> Iterator[None]:
    """``TRAINGUARD_DEMO_MODEL_MIB`` = ``mib`` while the run starts its processes (they read it
    through :class:`trainguard.demo.model.TaskConfig`); restored afterwards."""
    name = "TRAINGUARD_DEMO_MODEL_MIB"
    before = os.environ.get(name)
    os.environ[name] = str(mib)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
