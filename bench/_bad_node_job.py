"""One worker of bench/bad_node.py's job, started by ``trainguard launch`` on an emulated host.

``python bench/_bad_node_job.py OUT --steps N --step S --every E --bad-host H --active A
--ckpt C``: a :class:`trainguard.restart.Wrapper` job (``FillGaps`` + ``MaxActiveWorldSize(A)``,
gloo) of ``N`` steps in all. Each round starts from the job's last checkpoint (the step active
rank 0 wrote to ``OUT/ckpt`` every ``C`` steps; the ranks agree on the smallest they read),
does one all-reduce per step and sleeps ``S`` s. A rank on host ``H`` raises ``OSError`` after
``E`` steps of each round it is active in (a flaky host). Every step appends ``{rank, initial,
host, round, world, step, sum, time}`` to ``OUT/steps.jsonl``; imports done, ``{rank, pid,
time}`` to ``OUT/ready.jsonl``; the process's result goes to ``OUT/result-<RANK>-<pid>``.
Also the kill scenarios' job (``E`` 0: no flaky host; ``OUT/hold``: the job does not end).

The flaky rank leaves its process group up when it raises: a ``destroy_process_group()`` in a
``finally`` there closes the group's connections before the exception reaches the Wrapper, the
peers' all-reduces fail first, and the fault is attributed to a peer's host (measured: every
fault blamed on h1 with 2 workers per host).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src")]


def _append(path: Path, record: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step", type=float, default=0.02)
    p.add_argument("--every", type=int, default=30)
    p.add_argument("--bad-host", default="h2")
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--ckpt", type=int, default=20)
    args = p.parse_args()
    out, initial, host = args.out, int(os.environ["RANK"]), socket.gethostname()
    _append(
        out / "starts.jsonl",
        {"rank": initial, "pid": os.getpid(), "time": time.time(),
         "incarnation": os.environ.get("TRAINGUARD_INCARNATION")},
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr

    _append(out / "ready.jsonl", {"rank": initial, "pid": os.getpid(), "time": time.time()})

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(args.active),
        heartbeat_timeout=30,
        barrier_timeout=60,
    )
    def train(call: tr.CallWrapper) -> int:
        dist.init_process_group("gloo")
        try:
            ckpt = out / "ckpt"
            start = torch.tensor([int(ckpt.read_text()) if ckpt.exists() else 0])
            dist.all_reduce(start, op=dist.ReduceOp.MIN)
            step, ran = int(start.item()), 0
            while step < args.steps or (out / "hold").exists():
                total = torch.ones(1)
                dist.all_reduce(total)
                _append(
                    out / "steps.jsonl",
                    {"rank": call.rank, "initial": initial, "host": host, "round": call.round,
                     "world": call.world_size, "step": step, "sum": int(total.item()),
                     "time": time.time()},
                )  # fmt: skip
                ran += 1
                if args.every and host == args.bad_host and ran == args.every:
                    raise OSError(f"the GPU of {host} fell off the bus")
                step += 1
                if call.rank == 0 and step % args.ckpt == 0:
                    (out / ".ckpt").write_text(str(step))
                    os.replace(out / ".ckpt", ckpt)
                call.ping()
                time.sleep(args.step)
        except OSError:
            raise  # the flaky host's own fault: the Wrapper aborts the group (see below)
        except BaseException:
            dist.destroy_process_group()
            raise
        dist.destroy_process_group()
        return call.world_size

    result = train()
    (out / f"result-{initial}-{os.getpid()}").write_text(str(result or "spare"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
