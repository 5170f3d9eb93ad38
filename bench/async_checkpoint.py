"""Asynchronous checkpointing against its baselines, measured side by side in one run.

State: a model plus Adam state (params, exp_avg, exp_avg_sq in fp32 and a step per param),
tensors log-uniform from 4 KiB to 64 MiB, of a total size per ``--sizes`` (GiB). For each size
and each file system (``--dirs``, default /dev/shm and a directory on the disk):

- stall: ``save()`` (default: until staged; ``overlap=True``: until it returns), against one
  ``copy_`` of the same tensors into preallocated, already-touched memory (the memory-bandwidth
  limit), plain ``torch.save`` (synchronous) and ``torch.distributed.checkpoint.async_save``;
- time to durable and the writer's throughput, against the raw bandwidth of the same file
  system (one large sequential write from memory, then fsync);
- slowdown of a compute loop (matmuls) while the writer works;
- ``load`` (with checksum verification) against ``torch.load`` of the same state (warm cache);
- steady-state allocation: the staging buffer is the same object and RSS does not grow.

Run: ``.venv/bin/python bench/async_checkpoint.py [--sizes 1,4] [--dirs /dev/shm,/var/tmp]``.
Prints a table and writes bench/results/async_checkpoint.json.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import print_table, write_results
from trainguard.checkpoint import AsyncCheckpointer, load

GiB = 1 << 30


def make_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    per_copy = total_bytes // 3  # param, exp_avg, exp_avg_sq
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    used, i = 0, 0
    while used < per_copy:
        nbytes = int(math.exp(rng.uniform(math.log(4 << 10), math.log(64 << 20))))
        nbytes = min(nbytes, per_copy - used) // 4 * 4 or 4
        n = nbytes // 4
        model[f"layer{i}.weight"] = torch.empty(n).uniform_()
        opt_state[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.empty(n).uniform_(),
            "exp_avg_sq": torch.empty(n).uniform_(),
        }
        used += n * 4
        i += 1
    groups = [{"params": list(range(i)), "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}]
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}, "step": 10}


def tensors_of(state: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def raw_write(path: Path, buf: memoryview) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < len(buf):
            pos += os.write(fd, buf[pos : pos + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def compute_rate(seconds: float, stop=None) -> float:
    a = torch.randn(384, 384)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds and not (stop and stop()):
        a = torch.tanh(a @ a.T / 384)
        n += 1
    return n / (time.perf_counter() - started)


def bench_one(size_gib: float, directory: Path, repeat: int) -> dict[str, Any]:
    total = int(size_gib * GiB)
    state = make_state(total)
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    work = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=directory))
    r: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors), "dir": str(directory)}
    try:
        dst = [torch.empty_like(t) for t in tensors]
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)

        def copy_all() -> None:
            for d, s in zip(dst, tensors, strict=True):
                d.copy_(s)

        r["copy_s"] = statistics.median(timed(copy_all, max(5, repeat)))  # as the stalls
        dst.clear()

        raw = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        raw_s = [raw_write(work / "raw", memoryview(raw.numpy())) for _ in range(repeat)]
        del raw
        os.unlink(work / "raw")
        r["raw_write_s"] = min(raw_s)
        r["raw_bw"] = nbytes / r["raw_write_s"]

        with AsyncCheckpointer() as ckpt:
            ckpt.save(state, work / "warm")  # allocates and touches the staging buffer
            ckpt.wait()
            buffer = ckpt._stager.buffer
            rss_before = rss()
            stalls, durable, tput = [], [], []
            for i in range(repeat):
                infos: list[Any] = []
                started = time.perf_counter()
                ckpt.save(state, work / f"d{i}", on_durable=infos.append)
                stalls.append(time.perf_counter() - started)
                ckpt.wait()
                durable.append(infos[0].durable_seconds)
                tput.append(infos[0].throughput)
                os.unlink(work / f"d{i}")
            r["steady_rss_growth"] = rss() - rss_before
            r["buffer_reused"] = ckpt._stager.buffer is buffer
            r["stall_default_s"] = statistics.median(stalls)
            r["durable_s"] = statistics.median(durable)
            r["durable_bw"] = statistics.median(tput)
            over = []
            for i in range(repeat):
                started = time.perf_counter()
                ckpt.save(state, work / f"o{i}", overlap=True)
                over.append(time.perf_counter() - started)
                ckpt.wait_staged()
                ckpt.wait()
                os.unlink(work / f"o{i}")
            r["stall_overlap_s"] = statistics.median(over)

            alone = compute_rate(1.0)
            handle = ckpt.save(state, work / "busy")
            during = compute_rate(
                30.0, stop=lambda: handle is not None and handle.finished.is_set()
            )
            ckpt.wait()
            alone = (alone + compute_rate(1.0)) / 2
            r["compute_slowdown"] = 1.0 - during / alone
            path = work / "busy"

            load_s = timed(lambda: load(path), repeat)
            r["load_s"] = min(load_s)
        with AsyncCheckpointer(writer_nice=0) as ckpt:  # the cost of the lowered priority
            tput = []
            for i in range(repeat):
                infos: list[Any] = []
                ckpt.save(state, work / f"n{i}", on_durable=infos.append)
                ckpt.wait()
                tput.append(infos[0].throughput)
                os.unlink(work / f"n{i}")
            r["durable_bw_nice0"] = statistics.median(tput)
        r["torch_save_s"] = min(timed(lambda: torch.save(state, work / "t.pt"), repeat))
        r["torch_load_s"] = min(timed(lambda: torch.load(work / "t.pt", weights_only=True), repeat))
        os.unlink(work / "t.pt")

        import torch.distributed.checkpoint as dcp

        dcp_stalls = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(repeat + 1):
                started = time.perf_counter()
                future = dcp.async_save(state, checkpoint_id=work / f"dcp{i}", no_dist=True)
                if i:
                    dcp_stalls.append(time.perf_counter() - started)
                future.result()
                shutil.rmtree(work / f"dcp{i}")
        r["dcp_async_stall_s"] = statistics.median(dcp_stalls)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["targets"] = {
        "default stall <= 1.5 x copy": r["stall_default_s"] <= 1.5 * r["copy_s"],
        "overlap stall <= 5% torch.save": r["stall_overlap_s"] <= 0.05 * r["torch_save_s"],
        "durable >= 80% raw": r["durable_bw"] >= 0.8 * r["raw_bw"],
        "steady state allocates nothing": r["buffer_reused"] and r["steady_rss_growth"] < 64 << 20,
        "load >= 2x faster than torch.load": r["load_s"] * 2 <= r["torch_load_s"],
    }
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1", help="comma-separated GiB (issue: 1,4)")
    parser.add_argument(
        "--dirs", default="/dev/shm,/var/tmp", help="comma-separated directories to write in"
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for size in [float(s) for s in args.sizes.split(",")]:
        for d in args.dirs.split(","):
            print(f"... {size} GiB in {d}", flush=True)
            results[f"{size:g}GiB {d}"] = bench_one(size, Path(d), args.repeat)
    rows = []
    for key, r in results.items():
        rows.append(
            [
                key,
                r["tensors"],
                r["copy_s"],
                r["stall_default_s"],
                r["stall_overlap_s"],
                r["torch_save_s"],
                r["dcp_async_stall_s"],
                r["durable_s"],
                r["durable_bw"] / GiB,
                r["durable_bw_nice0"] / GiB,
                r["raw_bw"] / GiB,
                r["compute_slowdown"],
                r["load_s"],
                r["torch_load_s"],
            ]
        )
    print_table(
        "async checkpoint (seconds unless noted; bw in GiB/s; stalls and copy_: median, others: best or median of --repeat)",
        [
            "state",
            "tensors",
            "copy_",
            "save stall",
            "overlap stall",
            "torch.save",
            "dcp async stall",
            "durable",
            "durable bw",
            "(nice 0)",
            "raw bw",
            "compute slowdown",
            "load",
            "torch.load",
        ],
        rows,
    )
    for key, r in results.items():
        print(f"\ntargets, {key}:")
        for name, ok in r["targets"].items():
            print(f"  {'PASS' if ok else 'MISS'}  {name}")
    write_results("async_checkpoint", results)


if __name__ == "__main__":
    main()
