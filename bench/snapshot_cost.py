"""What peer snapshots add to a training step (issue 39): FSDP2 on a 1-D mesh, CPU/gloo.

The same job twice in one command, once with ``LiveState(snapshot_every=1)`` and once with a
``LiveState`` that takes none (the baseline): ``--ranks`` ranks under the Wrapper, a two-layer
model sharded with ``fully_shard`` so that each rank holds ``--mib`` MiB of state (parameter
shards and their AdamW ``exp_avg``/``exp_avg_sq``), ``--steps`` steps of forward, backward
and ``optimizer.step()`` inside ``live.update``.

The step is paced to ``--step-s`` seconds (default 1 s): after its real CPU work (forward,
backward with FSDP2's all-gathers and reduce-scatters over gloo, the AdamW update) a rank
sleeps until the step's time is up. The sleep stands for the accelerator's share of a step
on a GPU node, where the host cores are free while the device computes; that is where a
snapshot's copy and its transfer to the buddy are meant to run. With ``--step-s 0`` the
steps are not paced (every core busy with the step itself: the worst case).

Per run and rank: the step times (wall, from the start of forward to the end of the pacing
sleep; the first ``--warmup`` steps left out), the busy part of each step (before the
sleep), and with snapshots the copy and transfer time per snapshot and how long
``live.update`` waited for the previous snapshot. Printed as a table, written to
``bench/results/snapshot_cost.json`` (``--results NAME``).

Run: ``.venv/bin/python bench/snapshot_cost.py [--mib 256] [--ranks 2] [--step-s 1.0]
[--steps 14] [--warmup 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests._dist import run_ranks  # noqa: E402

from bench._common import print_table, summarize, write_results  # noqa: E402


def job(mib: int, steps: int, step_s: float, every: int | None) -> dict[str, Any]:
    """One rank of one run: its step times, busy times and snapshot statistics."""
    import torch
    import torch.distributed as dist
    from tests.live._jobs import TIMEOUTS
    from torch.distributed.device_mesh import init_device_mesh

    import trainguard.restart as tr
    from bench._sharded_job import BATCH, build, width
    from trainguard.live import LiveState

    live = LiveState(model=None, optimizer=None, snapshot_every=every)

    @tr.Wrapper(**TIMEOUTS)
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        net, opt = build(mesh, width(mib, world))
        got = live.recover(model=net, optimizer=opt)
        if got.step is None:
            live.restored(0)
        dim = net[0].in_features
        walls: list[float] = []
        busy: list[float] = []
        waited: list[float] = []
        snaps = live._snapshots()
        for step in range(steps):
            began = time.monotonic()
            gen = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(BATCH, dim, generator=gen)[call.rank :: world]
            net[2](net[1](net[0](x))).square().mean().backward()
            before = snaps.stats["waited_s"] if snaps is not None else 0.0
            with live.update(step, call):
                opt.step()
            opt.zero_grad()
            waited.append((snaps.stats["waited_s"] if snaps is not None else 0.0) - before)
            done = time.monotonic()
            busy.append(done - began)
            if step_s > 0:
                time.sleep(max(0.0, began + step_s - done))
            walls.append(time.monotonic() - began)
            call.ping()
        live.flush()
        stats = dict(snaps.stats) if snaps is not None else {}
        state_bytes = sum(
            t.to_local().numel() * t.to_local().element_size()
            for t in [*net.parameters(), *_adam_tensors(opt)]
        )
        dist.destroy_process_group()
        return {"wall": walls, "busy": busy, "waited": waited, "stats": stats, "bytes": state_bytes}

    return train()


def _adam_tensors(opt: Any) -> list[Any]:
    return [v for s in opt.state.values() for v in s.values() if getattr(v, "ndim", 0) > 0]


def run(args: argparse.Namespace, every: int | None) -> list[dict[str, Any]]:
    fn_args = (args.mib, args.steps, args.step_s, every)
    env = {"OMP_NUM_THREADS": "1"}
    results = run_ranks(job, args.ranks, args=fn_args, timeout=args.timeout, env=env)
    bad = [r for r in results if not r.returned]
    if bad:
        raise SystemExit(f"ranks failed: {[(r.rank, r.error, r.traceback) for r in bad]}")
    return [r.value for r in results]


def summary(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Over every rank's steps after the warm-up: wall and busy step times; the snapshots'."""
    wall = [w for r in ranks for w in r["wall"][warmup:]]
    busy = [b for r in ranks for b in r["busy"][warmup:]]
    waited = [w for r in ranks for w in r["waited"][warmup:]]
    out: dict[str, Any] = {
        "wall_s": summarize(wall),
        "busy_s": summarize(busy),
        "update_waited_s": summarize(waited),
        "state_mib_per_rank": statistics.fmean(r["bytes"] for r in ranks) / 2**20,
    }
    snaps = [r["stats"] for r in ranks if r["stats"].get("snapshots")]
    if snaps:
        out["copy_s_per_snapshot"] = statistics.fmean(s["copy_s"] / s["snapshots"] for s in snaps)
        out["transfer_s_per_snapshot"] = statistics.fmean(
            s["transfer_s"] / s["snapshots"] for s in snaps
        )
        out["snapshots_per_rank"] = statistics.fmean(s["snapshots"] for s in snaps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=1.0, help="paced step time (0: none)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--results", default="snapshot_cost")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    load = os.getloadavg()[0]
    started = time.monotonic()
    runs = {"without": summary(run(args, None), args.warmup)}
    runs["snapshot_every_1"] = summary(run(args, 1), args.warmup)
    base, snap = runs["without"], runs["snapshot_every_1"]
    added = snap["wall_s"]["p50"] / base["wall_s"]["p50"] - 1.0
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                round(r["state_mib_per_rank"], 1),
                1000 * r["wall_s"]["p50"],
                1000 * r["wall_s"]["p95"],
                1000 * r["busy_s"]["p50"],
                1000 * r["update_waited_s"]["p50"],
                1000 * r.get("copy_s_per_snapshot", 0.0),
                1000 * r.get("transfer_s_per_snapshot", 0.0),
            ]
        )
    print_table(
        f"peer snapshots, FSDP2 1-D, {args.ranks} ranks, {args.mib} MiB per rank, step paced to "
        f"{args.step_s:g} s; steps {args.warmup + 1}-{args.steps} of every rank",
        [
            "run",
            "state MiB/rank",
            "step p50 ms",
            "step p95 ms",
            "busy p50 ms",
            "update() waited p50 ms",
            "copy/snapshot ms",
            "transfer/snapshot ms",
        ],
        rows,
    )
    target = 0.05
    print(
        f"\nadded to the step (p50): {100 * added:+.1f} % (target at most {100 * target:.0f} %: "
        f"{'met' if added <= target else 'NOT met'}); load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; {time.monotonic() - started:.0f} s"
    )
    write_results(
        args.results,
        {
            "args": vars(args),
            "runs": runs,
            "added_p50": added,
            "target": target,
            "met": added <= target,
            "load_before": load,
            "load_after": os.getloadavg()[0],
        },
    )


if __name__ == "__main__":
    main()
