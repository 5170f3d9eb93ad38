"""Local checkpoints with replication against their baselines, measured in one run.

4 ranks on this machine (as 2 "nodes" of 2: TRAINGUARD_HOST_NAME=node0/node1,
CliqueReplication(factor=2) by host, so each part is copied to the rank two away), ``--mib`` MiB
of state per rank, roots in /dev/shm.
Every rank measures, with barriers between the steps:

- raw write: its part's bytes written to a file in /dev/shm (write + fsync), all ranks at once;
- gloo transfer: the same bytes sent to its clique peer while receiving the peer's (plain
  ``isend``/``irecv`` on the default gloo group, all pairs at once), as replication does;
- copy: one ``copy_`` of the state into preallocated, touched memory (the staging limit);
- save stall: ``save()`` until it returns; durable: ``save()`` until ``wait()`` returns, i.e.
  every part and every replica durable on every rank;
- load local: ``find_latest()`` + ``load()`` with every part local (checksums verified);
- load from a peer: rank 1's root is deleted first; its ``load()`` receives the part from rank 3.

Targets (issue 6): stall as in the async benchmark (<= 1.5 x copy); durable <= 1.5 x (raw write +
gloo transfer); load from a peer <= 1.2 x gloo transfer.

Run: ``.venv/bin/python bench/local_checkpoint.py [--mib 256] [--repeat 3]``.
The first round warms up (staging and receive buffers are allocated once) and is not counted.
Prints a table and writes bench/results/local_checkpoint.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, print_table, write_results

WORLD = 4
MiB = 1 << 20


def make_state(nbytes: int, rank: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    sizes = [nbytes // 2, nbytes // 4, nbytes // 8]
    sizes.append(nbytes - sum(sizes))
    return {
        "model": {f"w{i}": torch.rand(s // 4, generator=g) for i, s in enumerate(sizes)},
        "step": 1,
    }


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _raw_write(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < len(data):
            pos += os.write(fd, data[pos : pos + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_main(rank: int, port: int, mib: int, repeat: int, base: str, nice: int, conn: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TRAINGUARD_HOST_NAME=f"node{rank // 2}",
    )
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    peer = (rank + 2) % WORLD
    nbytes = mib * MiB
    state = make_state(nbytes, rank)
    flat = torch.cat([t.view(-1).view(torch.uint8) for t in state["model"].values()])
    out: dict[str, list[float]] = {
        k: [] for k in ("raw", "gloo", "copy", "stall", "durable", "load_local", "load_peer")
    }
    root = os.path.join(base, f"rank{rank}")
    recv = torch.empty_like(flat)
    copy_dst = [torch.empty_like(t) for t in state["model"].values()]
    for dst in copy_dst:
        dst.fill_(0)
    mgr = LocalCheckpointManager(
        root,
        replication=CliqueReplication(factor=2),
        keep=2,
        timeout=600,
        staging_threads=1,
        writer_nice=nice,
    )
    try:
        for it in range(repeat + 1):  # the first round warms up (buffers, writer): not counted
            dist.barrier()
            out["raw"].append(
                _timed(lambda: _raw_write(f"{base}/raw{rank}", memoryview(flat.numpy())))
            )
            os.unlink(f"{base}/raw{rank}")
            dist.barrier()

            def transfer() -> None:
                ops = [dist.P2POp(dist.isend, flat, peer), dist.P2POp(dist.irecv, recv, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            out["gloo"].append(_timed(transfer))
            dist.barrier()
            out["copy"].append(
                _timed(lambda: torch._foreach_copy_(copy_dst, list(state["model"].values())))
            )
            dist.barrier()
            started = time.perf_counter()
            mgr.save(state, it)
            out["stall"].append(time.perf_counter() - started)
            mgr.wait()
            out["durable"].append(time.perf_counter() - started)
            dist.barrier()
            found = mgr.find_latest()
            assert found == it, (found, it)
            out["load_local"].append(_timed(lambda it=it: mgr.load(it)))
            dist.barrier()
            if rank == 1:
                shutil.rmtree(root)
                os.makedirs(root)
            dist.barrier()
            seconds = _timed(lambda it=it: mgr.load(it))
            if rank == 1:
                out["load_peer"].append(seconds)
            dist.barrier()
        conn.send({k: v[1:] for k, v in out.items()})
    finally:
        mgr.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state per rank (MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument(
        "--writer-nice", type=int, default=10, help="nice increment of the writer processes"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # the machine's 1-minute load when the run started
    base = Path(args.dir) / f"trainguard-bench-local-{os.getpid()}"
    base.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        for rank in range(WORLD):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=rank_main,
                args=(rank, port, args.mib, args.repeat, str(base), args.writer_nice, send),
            )
            p.start()
            pipes.append(recv)
            procs.append(p)
        results = [conn.recv() for conn in pipes]
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(base, ignore_errors=True)

    def med(key: str, ranks: range | list[int] = range(WORLD)) -> float:
        # per repetition the slowest rank counts (the job waits for it); then the median
        per_rep = [max(results[r][key][i] for r in ranks) for i in range(args.repeat)]
        return statistics.median(per_rep)

    row = {
        "mib_per_rank": args.mib,
        "ranks": WORLD,
        "writer_nice": args.writer_nice,
        "load_average_before": load_before,
        "raw_write_s": med("raw"),
        "gloo_transfer_s": med("gloo"),
        "copy_s": med("copy"),
        "save_stall_s": med("stall"),
        "durable_s": med("durable"),
        "load_local_s": med("load_local"),
        "load_peer_s": med("load_peer", [1]),
    }
    row["raw_bw_MBps"] = args.mib * MiB / row["raw_write_s"] / 1e6
    row["gloo_bw_MBps"] = args.mib * MiB / row["gloo_transfer_s"] / 1e6
    row["targets"] = {
        "stall <= 1.5 x copy": row["save_stall_s"] <= 1.5 * row["copy_s"],
        "durable <= 1.5 x (raw write + gloo transfer)": row["durable_s"]
        <= 1.5 * (row["raw_write_s"] + row["gloo_transfer_s"]),
        "load from peer <= 1.2 x gloo transfer": row["load_peer_s"] <= 1.2 * row["gloo_transfer_s"],
    }
    print_table(
        f"local checkpoints, {WORLD} ranks x {args.mib} MiB, {args.dir} (median of "
        f"{args.repeat}, slowest rank)",
        ["measure", "seconds"],
        [(k, v) for k, v in row.items() if k.endswith("_s")],
    )
    for name, ok in row["targets"].items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")
    key = f"{args.mib}MiB x {WORLD} ranks {args.dir} nice {args.writer_nice}"
    previous: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        previous = json.loads((RESULTS / "local_checkpoint.json").read_text())["results"]
    write_results("local_checkpoint", {**previous, key: row})


if __name__ == "__main__":
    main()
