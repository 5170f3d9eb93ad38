"""Live-state transfer (:mod:`trainguard.live._transfer`) against a plain gloo send.

Two gloo ranks on this machine. Rank 0 holds a state of ``--mib`` MiB: one large tensor, as the
demo's ``--model-mib`` pad, plus 20 small ones that travel in the pack. Rank 1 receives it
into its own tensors of the same shapes, in place, as a spare or a torn rank does. Each
repetition times three things back to back, each from a barrier to a barrier:

- ``plain``: one ``dist.send``/``dist.recv`` of the large tensor's bytes. This is the baseline
  that issue 33's target names.
- ``live``: ``prepare`` + ``send`` on the donor; ``receive`` (checksums included) and the
  ``copy_`` that loading does on the receiver.
- ``live, no checksums``: the same with the checksum function replaced by a constant. It is a
  diagnostic of what checksumming costs on this machine; the library always checksums.

It reports the median of each, and the ratios to ``plain``. The target (issue 33) is a
transfer of one replica's state of at most 1.2 times a plain send of those bytes.

By default both ranks run on this machine and talk over loopback, where the copy keeps the
CPUs busy. ``--link RATE`` (root and ``ip`` needed) runs them on two emulated hosts instead
(``tests/cluster/_hosts.py``: network namespaces on a bridge), each host's link shaped to
``RATE`` with ``tc``'s token bucket (``8gbit``, ``1gbit``, ...). There the link, not the CPU,
bounds the send, as on a cluster.

Run: ``.venv/bin/python bench/live_transfer.py [--mib 256] [--repeats 25] [--link 8gbit]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks

from bench._common import print_table, write_results

RATIO = 1.2
KINDS = ("plain", "live", "live, no checksums")


def _job(mib: int, repeats: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from trainguard.live import _transfer

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        state = {
            "pad": torch.full(((mib << 20) // 4,), float(rank)),
            "small": [torch.full((100,), float(rank + i)) for i in range(20)],
        }
        recv_buf = torch.ones(mib << 20, dtype=torch.uint8)
        real_digest = _transfer._digest
        took: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(repeats):
            for kind in KINDS:
                _transfer._digest = (lambda t: 0) if kind.endswith("checksums") else real_digest  # type: ignore[assignment]
                dist.barrier()
                start = time.perf_counter()
                if kind == "plain":
                    if rank == 0:
                        dist.send(state["pad"].view(torch.uint8), 1)
                    else:
                        dist.recv(recv_buf, 0)
                elif rank == 0:
                    for work in _transfer.send(_transfer.prepare(state, 1), 1):
                        work.wait()
                else:
                    got = _transfer.receive(0, 1, into=_transfer.own_bytes(state))
                    if got.problem is not None:
                        raise RuntimeError(got.problem)
                    state["pad"].copy_(got.state["pad"])
                dist.barrier()
                took[kind].append(time.perf_counter() - start)
        _transfer._digest = real_digest
        return took
    finally:
        dist.destroy_process_group()


def _on_hosts(mib: int, repeats: int, rate: str) -> dict[str, list[float]]:
    """Run :func:`_job` as rank 0 on one emulated host and rank 1 on another, each host's link
    shaped to ``rate``; rank 1's timings."""
    from tests.cluster._hosts import Cluster, unavailable

    why = unavailable()
    if why is not None:
        raise SystemExit(f"--link needs emulated hosts: {why}")
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), 2) as cluster:
        for host in cluster.hosts:
            cluster.run(host, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                               "burst", "4mb", "latency", "100ms"])  # fmt: skip
        out = Path(tmp, "rank1.json")
        port = str(random.randint(20000, 40000))  # a fresh namespace: nothing else listens
        procs = []
        for rank, host in enumerate(cluster.hosts):
            env = {**os.environ, "MASTER_ADDR": cluster.hosts[0].addr, "MASTER_PORT": port,
                   "RANK": str(rank), "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip
            argv = [sys.executable, __file__, "--mib", str(mib), "--repeats", str(repeats)]
            argv += ["--worker-out", str(out)]
            procs.append(cluster.start(host, argv, log=Path(tmp, f"rank{rank}.log"), env=env))
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(900)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                log = Path(tmp, f"rank{rank}.log").read_text()[-3000:]
                raise RuntimeError(
                    f"rank {rank} on {cluster.hosts[rank].name} ended {code}:\n{log}"
                )
        return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the large tensor's MiB")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--link", help="run on two emulated hosts, links shaped to this rate")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # a rank of --link
    args = parser.parse_args()
    if args.worker_out:
        took = _job(args.mib, args.repeats)
        if int(os.environ["RANK"]) == 1:
            Path(args.worker_out).write_text(json.dumps(took))
        return
    if args.link:
        took = _on_hosts(args.mib, args.repeats, args.link)
    else:
        took = run_ranks(_job, 2, args=(args.mib, args.repeats), timeout=900)[1].get()
    median = {k: statistics.median(v) for k, v in took.items()}
    rows: list[list[Any]] = []
    for kind in KINDS:
        ratio = median[kind] / median["plain"]
        met = "" if kind != "live" else ("yes" if ratio <= RATIO else "no")
        rows.append([kind, median[kind] * 1e3, min(took[kind]) * 1e3, ratio, met])
    where = f"2 emulated hosts, links shaped to {args.link}" if args.link else "loopback"
    print_table(
        f"live transfer of {args.mib} MiB, 2 gloo ranks ({where}), {args.repeats} repeats (ms)",
        ["transfer", "median", "min", "x plain", f"<= {RATIO}x"],
        rows,
    )
    write_results(
        f"live_transfer_{args.link}" if args.link else "live_transfer",
        {
            "link": args.link,
            "mib": args.mib,
            "repeats": args.repeats,
            "median_s": median,
            "ratio_to_plain": {k: median[k] / median["plain"] for k in KINDS},
            "target_ratio": RATIO,
            "samples_s": took,
        },
    )


if __name__ == "__main__":
    main()
