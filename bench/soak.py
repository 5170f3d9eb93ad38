"""Soak: a training job under a random fault schedule must lose nothing and leak nothing.

4 ranks + 1 spare train the demo's model (:mod:`trainguard.demo.model`) under
:class:`trainguard.restart.Wrapper`, with replicated local checkpoints every few steps and disk
checkpoints (:class:`trainguard.checkpoint.AsyncCheckpointer`) on a small tmpfs, while a fault
schedule drawn from ``--seed`` injects ``--faults`` faults of the kinds in
:mod:`bench._soak_plan` (exception, hang, kill, writer, watcher, lostdir, diskfull). Ranks
that leave the job (SIGKILL) are replaced by the spare; the node watcher's loss takes them all.
When none is left the job ends and the soak starts a fresh set of processes that resume from the newest checkpoint
(a job-level restart, counted and timed separately; see :mod:`bench._soak_run`).

At the end it checks: the final parameters are bit-identical to a fault-free run of the same
steps; every committed disk checkpoint loads (every rank's part), passes ``trainguard ckpt
verify`` and holds the fault-free run's parameters of its step; no process carrying the run's
marker, no new ``/dev/shm`` entry, no thread or file descriptor left in any process that
returned from the wrapper; every scheduled fault was injected and recovered; the RSS of the
ranks that finished is flat (first vs last quarter of their steps). It prints the fault mix,
each fault's recovery time (fault -> every active rank training again) and a summary, and
writes JSON (``bench/results/soak.json`` unless ``--json``). Exit status 0 when every check
holds, 1 otherwise.

Run: ``.venv/bin/python bench/soak.py [--faults 100] [--seed 0]`` (as root: it mounts a tmpfs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _soak_check as check
from bench import _soak_report as report
from bench import _soak_run as run
from bench._soak_plan import KINDS, SoakConfig, draw_schedule, steps_for

PART_BYTES = 512 * 1024  # generous size of one rank's part of a disk checkpoint of the demo model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=100, help="number of faults (100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (0)")
    p.add_argument("--gap", type=int, default=12, help="steps per fault window (12)")
    p.add_argument("--local-every", type=int, default=4, help="local checkpoint every N steps")
    p.add_argument("--disk-every", type=int, default=12, help="disk checkpoint every N steps")
    p.add_argument("--soft-timeout", type=float, default=3.0, help="hang detection, seconds")
    p.add_argument(
        "--kinds", default=",".join(KINDS), help=f"fault kinds to draw from ({','.join(KINDS)})"
    )
    p.add_argument("--out", help="run directory (default: a new one under the temp dir)")
    p.add_argument("--json", help="where to write the results (default bench/results/soak.json)")
    p.add_argument("--stall", type=float, default=120.0, help="no step for this long = hang")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this long")
    p.add_argument("--no-mount", action="store_true", help="never mount a tmpfs (fallback)")
    args = p.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown or args.faults < 1 or args.gap < 4:
        p.error(f"bad --kinds {sorted(unknown)}" if unknown else "--faults >= 1, --gap >= 4")
    return args


def make_config(args: argparse.Namespace, out: Path, disk: Path) -> SoakConfig:
    kinds = tuple(k for k in KINDS if k in args.kinds.split(","))
    common = {"gap": args.gap, "local_every": args.local_every, "disk_every": args.disk_every}
    faults = draw_schedule(args.seed, args.faults, ranks=4, kinds=kinds, **common)
    return SoakConfig(
        out=str(out),
        disk=str(disk),
        seed=args.seed,
        steps=steps_for(args.faults, args.gap),
        soft_timeout=args.soft_timeout,
        hard_timeout=max(10.0, 3 * args.soft_timeout),
        faults=faults,
        marker=uuid.uuid4().hex,
        **common,
    )


@contextlib.contextmanager
def disk_root(out: Path, size: int, *, allow_mount: bool) -> Iterator[tuple[Path, str]]:
    """The disk-checkpoint root: a tmpfs of ``size`` bytes mounted at ``out/disk``; where
    mounting is not permitted, a directory under /dev/shm (then a full disk fills /dev/shm,
    which every process of this machine shares)."""
    disk = out / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    mounted = allow_mount and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k,mode=0700", "tmpfs", str(disk)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        mode = f"tmpfs of {size / 2**20:.0f} MiB mounted at {disk}"
    else:
        disk.rmdir()
        disk = Path(tempfile.mkdtemp(prefix="trainguard-soak-disk-", dir="/dev/shm"))
        mode = (
            f"FALLBACK (mount not permitted): a directory in /dev/shm, {disk}; full = /dev/shm full"
        )
    try:
        yield disk, mode
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        else:
            shutil.rmtree(disk, ignore_errors=True)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or tempfile.mkdtemp(prefix="trainguard-soak-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = steps_for(args.faults, args.gap) // args.disk_every + 1
    size = 16 * 2**20 + checkpoints * 4 * PART_BYTES
    shm_before = check.shm_entries()
    with disk_root(out, size, allow_mount=not args.no_mount) as (disk, mode):
        cfg = make_config(args, out, disk)
        cfg.save()
        print(f"soak: {len(cfg.faults)} faults, seed {cfg.seed}, {cfg.steps} steps, run {out}")
        print(f"disk checkpoints: {mode}", flush=True)
        ref = run.reference(cfg, timeout=600)
        print(f"reference run: {ref['seconds']:.1f} s, parameters {ref['final'][0][:16]}")
        t0 = time.time()
        segments = run.run_job(
            cfg, stall=args.stall, timeout=args.timeout, max_segments=len(cfg.faults) + 2
        )
        wall = time.time() - t0
        disk_check = check.verify_disk(disk, cfg.ranks, ref["disk_saves"])
        stray = sorted(p.name for p in disk.rglob("*.tmp"))
    time.sleep(2)  # entries that a process was removing while it exited
    shm_new = sorted(check.shm_entries() - shm_before)
    return report.analyze(
        cfg, ref, segments, wall=wall, disk_check=disk_check, disk_mode=mode,
        stray_tmp=stray, shm_new=shm_new,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = soak(args)
    report.show(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")
    else:
        from bench._common import write_results

        write_results("soak", results)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
