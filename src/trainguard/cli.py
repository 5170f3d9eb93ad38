"""The ``trainguard`` command.

Subcommands:

- ``trainguard events RUN_DIR``: merge a run's event logs and print them in time order.
- ``trainguard ckpt ls ROOT | verify PATH | show PATH``: inspect checkpoints on disk.
- ``trainguard report RUN_DIR [--json] [--plot FILE.png]``: goodput table and timeline.
- ``trainguard demo``: train a small model through injected faults; check nothing was lost.
- ``trainguard launch [torchrun options] script.py [args]``: start a job like torchrun; a dead
  worker is respawned alone (see :mod:`trainguard.launch`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard import __version__, events
from trainguard.checkpoint import _cli as ckpt_cli


def _events_dir(run_dir: str) -> Path | None:
    """Where ``run_dir``'s event logs are: ``run_dir`` itself when it holds ``events-*.jsonl``
    files, else its one subdirectory that does (``trainguard demo`` writes ``RUN/events``);
    with several, the first in name order, after a line naming the others. None: none."""
    root = Path(run_dir)
    if any(root.glob("events-*.jsonl")):
        return root
    found = sorted(d for d in root.glob("*/") if d.is_dir() and any(d.glob("events-*.jsonl")))
    if not found:
        return None
    if len(found) > 1:
        others = ", ".join(str(d) for d in found[1:])
        print(f"reading {found[0]}; other event logs: {others}", file=sys.stderr)
    return found[0]


def _read(run_dir: str) -> list[dict[str, Any]] | None:
    """The merged events of ``run_dir`` (see :func:`_events_dir`); None after an error line."""
    directory = _events_dir(run_dir)
    merged = events.read_events(directory) if directory is not None else []
    if not merged:
        print(
            f"no events under {run_dir} (expected events-*.jsonl files there or in one of its "
            "subdirectories, e.g. RUN/events; give the directory set as TRAINGUARD_EVENTS_DIR)",
            file=sys.stderr,
        )
        return None
    return merged


def _cmd_events(args: argparse.Namespace) -> int:
    found = _read(args.run_dir)
    if found is None:
        return 1
    merged = [e for e in found if e.get("kind") in args.kind] if args.kind else found
    if not merged:
        print(f"no events of kind {', '.join(args.kind)} under {args.run_dir}", file=sys.stderr)
        return 1
    for event in merged:
        if args.json:
            print(json.dumps(event, separators=(",", ":")))
            continue
        extra = {
            k: v
            for k, v in event.items()
            if k not in ("time", "host", "pid", "rank", "round", "kind", "duration")
        }
        duration = event.get("duration")
        print(
            f"{event['time']:.6f}  rank={event.get('rank')!s:>4}  round={event.get('round')!s:>3}  "
            f"{event.get('kind', '?'):<16}"
            + (f" {duration * 1e3:9.2f} ms" if isinstance(duration, (int, float)) else " " * 13)
            + (f"  {json.dumps(extra, default=str)}" if extra else "")
        )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from trainguard import report

    merged = _read(args.run_dir)
    if merged is None:
        return 1
    result = report.analyze(merged)
    if args.plot:
        from trainguard.report._plot import plot_timeline

        try:
            plot_timeline(merged, result, args.plot)
        except ImportError as exc:
            print(f"trainguard report: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(report.format_table(result))
        if args.plot:
            print(f"timeline written to {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description=(
            "Keep PyTorch training jobs making progress through faults. "
            "The library is used from Python; this tool inspects what it recorded."
        ),
        epilog="Run 'trainguard COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "events",
        help="print a run's event logs merged in time order",
        description="Merge every events-*.jsonl file under RUN_DIR and print them in time order.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="directory given as TRAINGUARD_EVENTS_DIR, or the directory above it "
        "(a `trainguard demo` run directory: its events/)",
    )
    p.add_argument("--kind", action="append", help="only events of this kind (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")
    p.set_defaults(func=_cmd_events)

    p = sub.add_parser(
        "report",
        help="goodput of a run: productive time, checkpoint stalls, the cost of each fault",
        description=(
            "Merge RUN_DIR's event logs and print how the wall time splits into kept training "
            "steps, checkpoint stalls, each fault's phases (recomputed steps, detection, abort, "
            "restart barrier, re-initialization) and the rest; the rows add up to the wall time."
        ),
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="directory given as TRAINGUARD_EVENTS_DIR, or the directory above it "
        "(a `trainguard demo` run directory: its events/)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw a timeline, one lane per rank (needs: pip install 'trainguard[report]')",
    )
    p.set_defaults(func=_cmd_report)

    ckpt_cli.add_parser(sub)
    sub.add_parser(
        "launch",
        add_help=False,
        help="start a training job like torchrun; a dead worker is respawned alone "
        "('trainguard launch --help' lists the options)",
    )
    from trainguard.demo import runner as demo_runner

    demo_runner.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # everything after it is torchrun's and the script's
        from trainguard.launch.cli import main as launch_main

        return launch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except OSError as exc:  # an unreadable file or directory: one line, not a traceback
        print(f"trainguard {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
