"""Plain-Python workers for the launcher tests (no torch import: they start in ~0.05 s).

Run as ``python tests/launch/_workers.py MODE OUT [options]``; every worker appends one JSON line
to ``OUT/starts.jsonl`` when it starts (rank, local rank, pid, generation, incarnation).

Modes:
- ``run``: count steps in ``OUT/progress-<rank>`` (continuing from the count a dead
  predecessor left there) every ``--step`` seconds until ``OUT/stop`` exists or ``--steps``
  are done, then exit 0 (``--endless-rank R``: rank R ignores ``--steps``).
  ``--crash-gen G --crash-rank R``: rank R of generation G exits 3 at once.
- ``env``: write the environment to ``OUT/env-<rank>.json`` and exit 0. Any mode with
  ``--dump-env``: write ``{env, argv, path0}`` (the environment, ``sys.argv``, ``sys.path[0]``)
  to ``OUT/env-<rank>-<incarnation>.json`` at its start.
- ``gloo``: (imports torch) init a gloo group from torchrun's variables, ``--steps`` all_reduces
  (rank ``--crash-rank`` of generation ``--crash-gen`` exits 3 after the first), write the sum
  of the last one to ``OUT/sum-<rank>``; ``--log-steps``: append each step to
  ``OUT/steps.jsonl`` (``round`` is torchrun's restart count).
- ``wrapper``: (imports torch) a :class:`trainguard.restart.Wrapper` job (``FillGaps`` and
  ``MaxActiveWorldSize(--active)``): each round inits gloo and runs ``--steps`` all_reduces of
  ones, appending ``{rank, initial, pid, round, world, step, sum}`` to ``OUT/steps.jsonl``;
  ``OUT/result-<RANK>-<pid>`` gets the last round's world size (or ``spare``). A round goes on
  past ``--steps`` while ``OUT/hold`` exists. Its imports done, it appends ``{rank, pid, time}``
  to ``OUT/ready.jsonl`` (its start-up, for bench/launch.py). In generation ``--raise-gen``
  every round raises the same error before it builds a group (the Wrapper gives up after
  ``max_repeated_faults`` rounds). The first process of rank ``--gil-hang-rank`` hangs holding
  the GIL at step 3 (``--hard-timeout``). A process of a later incarnation (a respawn, a
  replacement node's) first sleeps ``--newcomer-delay`` seconds, as a slow import would: its
  agent has no worker in a wrapped call meanwhile. A rank on host ``--raise-host`` (its
  ``socket.gethostname()``) raises ``OSError`` at step ``--raise-step`` of each round it is
  active in (with ``--raise-while PATH``: only while PATH exists), a flaky host.
- ``term``: like ``run``, but a SIGTERM makes the worker write the time it came to
  ``OUT/term-<rank>`` and exit with status 75 (a worker that saved on a preemption).
- ``preempt``: (imports torch) the preemption tests' job (``tests/restart/_preempt_jobs.py``),
  ``--steps`` steps, checkpoints under ``OUT``; writes its final parameters to
  ``OUT/result-<rank>.json``; preempted, it exits with status 75.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path


def _append(path: Path, record: dict[str, object]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def term(out: Path, rank: int, args: argparse.Namespace) -> int:
    def on_term(signum: int, frame: object) -> None:
        (out / f"term-{rank}").write_text(repr(time.time()))
        os._exit(75)

    signal.signal(signal.SIGTERM, on_term)
    return run(out, rank, args)


def run(out: Path, rank: int, args: argparse.Namespace) -> int:
    generation = os.environ.get("TRAINGUARD_GENERATION")
    if args.crash_rank == rank and generation == str(args.crash_gen):
        return 3
    counter = out / f"progress-{rank}"
    step = _progress(counter)
    done = 0
    steps = None if rank == args.endless_rank else args.steps
    while not (out / "stop").exists() and (steps is None or done < steps):
        step += 1
        done += 1
        tmp = counter.with_suffix(f".{os.getpid()}")
        tmp.write_text(str(step))
        os.replace(tmp, counter)
        time.sleep(args.step)
    return 0


def gloo(out: Path, rank: int, args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.zeros(1)
    for step in range(args.steps or 3):
        total = torch.ones(1)
        dist.all_reduce(total)
        if args.log_steps:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            record = {"rank": rank, "pid": os.getpid(), "round": restarts, "step": step}
            _append(
                out / "steps.jsonl", {**record, "world": dist.get_world_size(), "time": time.time()}
            )
        crash = args.crash_rank == rank and os.environ.get("TRAINGUARD_GENERATION") == str(
            args.crash_gen
        )
        if crash and step == 0:
            os._exit(3)
        time.sleep(args.step)
    (out / f"sum-{rank}").write_text(str(int(total.item())))
    dist.destroy_process_group()
    return 0


class Flaky(OSError):
    """The fault of a flaky host (``--raise-host``)."""


def _flaky(args: argparse.Namespace) -> bool:
    import socket

    if args.raise_host is None or socket.gethostname() != args.raise_host:
        return False
    return args.raise_while is None or Path(args.raise_while).exists()


def wrapper(out: Path, rank: int, args: argparse.Namespace) -> int:
    if os.environ.get("TRAINGUARD_INCARNATION") != "0":
        time.sleep(args.newcomer_delay)
    import torch
    import torch.distributed as dist

    from trainguard import restart as tr

    first = os.environ.get("TRAINGUARD_INCARNATION") == "0"
    _append(out / "ready.jsonl", {"rank": rank, "pid": os.getpid(), "time": time.time()})

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(args.active),
        soft_timeout=args.hard_timeout / 2,
        hard_timeout=args.hard_timeout,
        heartbeat_timeout=30,
        barrier_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        if os.environ.get("TRAINGUARD_GENERATION") == str(args.raise_gen):
            raise RuntimeError("a fault that restarting in-process cannot cure")
        dist.init_process_group("gloo")
        try:
            step = 0
            while step < (args.steps or 20) or (out / "hold").exists():
                total = torch.ones(1)
                dist.all_reduce(total)
                record = {
                    "rank": call.rank,
                    "initial": rank,
                    "pid": os.getpid(),
                    "round": call.round,
                    "world": call.world_size,
                    "step": step,
                    "sum": int(total.item()),
                    "time": time.time(),
                }
                _append(out / "steps.jsonl", record)
                if step == args.raise_step and _flaky(args):
                    # the group stays up (the Wrapper aborts it): destroying it here would
                    # fail the peers' collectives first, and attribution would blame them
                    raise Flaky(f"the NIC of {args.raise_host} dropped the link")
                if first and rank == args.gil_hang_rank and step == 3:
                    re.match(r"(a+)+$", "a" * 64 + "b")  # holds the GIL for ever
                call.ping()
                time.sleep(args.step)
                step += 1
        except Flaky:
            raise
        except BaseException:
            dist.destroy_process_group()
            raise
        dist.destroy_process_group()
        return call.world_size

    result = train()
    (out / f"result-{rank}-{os.getpid()}").write_text(str(result if result else "spare"))
    return 0


def preempt(out: Path, rank: int, args: argparse.Namespace) -> int:
    from tests.restart._preempt_jobs import train_job

    params = train_job(str(out), steps=args.steps)  # raises Preempted (exit status 75)
    (out / f"result-{rank}.json").write_text(json.dumps(params))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "env", "gloo", "wrapper", "preempt", "term"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--step", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--crash-gen", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=None)
    parser.add_argument("--endless-rank", type=int, default=None)
    parser.add_argument("--active", type=int, default=2)
    parser.add_argument("--raise-gen", type=int, default=None)
    parser.add_argument("--gil-hang-rank", type=int, default=None)
    parser.add_argument("--hard-timeout", type=float, default=20.0)
    parser.add_argument("--log-steps", action="store_true")
    parser.add_argument("--newcomer-delay", type=float, default=0.0)
    parser.add_argument("--dump-env", action="store_true")
    parser.add_argument("--raise-host", default=None)
    parser.add_argument("--raise-step", type=int, default=2)
    parser.add_argument("--raise-while", default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    _append(
        args.out / "starts.jsonl",
        {
            "rank": rank,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "pid": os.getpid(),
            "generation": os.environ.get("TRAINGUARD_GENERATION"),
            "incarnation": os.environ.get("TRAINGUARD_INCARNATION"),
            "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "time": time.time(),
        },
    )
    print(f"worker rank {rank} incarnation {os.environ.get('TRAINGUARD_INCARNATION')}", flush=True)
    if args.dump_env:
        seen = {"env": dict(os.environ), "argv": sys.argv, "path0": sys.path[0]}
        incarnation = os.environ.get("TRAINGUARD_INCARNATION")
        (args.out / f"env-{rank}-{incarnation}.json").write_text(json.dumps(seen))
    if args.mode == "env":
        (args.out / f"env-{rank}.json").write_text(json.dumps(dict(os.environ), sort_keys=True))
        return 0
    if args.mode == "gloo":
        return gloo(args.out, rank, args)
    if args.mode == "wrapper":
        return wrapper(args.out, rank, args)
    if args.mode == "preempt":
        return preempt(args.out, rank, args)
    if args.mode == "term":
        return term(args.out, rank, args)
    return run(args.out, rank, args)


if __name__ == "__main__":
    raise SystemExit(main())
