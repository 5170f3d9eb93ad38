"""Sharded (FSDP2) checkpoints against torch.distributed.checkpoint, side by side in one run.

4 ranks (gloo, CPU), a stack of ``Linear`` layers of ``--params-gib`` GiB of parameters in all,
sharded with ``fully_shard`` on ``init_device_mesh("cpu", (4,))``, plus its Adam state (one
step taken): the state of each rank is ``get_state_dict(model, optimizer)`` (DTensor shards of
parameters, exp_avg and exp_avg_sq, a step tensor per parameter). Measured, with barriers
between the steps (per repetition the slowest rank counts, then the median of ``--repeat``):

- staging copy: one ``copy_`` of every rank's local shards into preallocated, touched memory
  (the floor of any save's stall);
- trainguard ``AsyncCheckpointer.save``: stall (until it returns) and time to durable
  (``wait()``: every rank's file durable and the checkpoint committed);
- ``dcp.async_save`` with the default ``FileSystemWriter``: stall and time to durable;
- ``dcp.save``: its time (synchronous);
- ``trainguard.checkpoint.dcp`` (``dcp.async_save`` with trainguard's ``StorageWriter`` and
  ``AsyncStager``), when that module exists: stall and time to durable;
- loads into the same 4-rank sharding, then (3 fresh ranks) resharded into 3 ranks:
  trainguard ``load(path, into=state)`` (when ``load`` has ``into=``), ``dcp.load`` and
  ``dcp.load`` through trainguard's ``StorageReader``; with the bytes each rank read
  (``rchar`` of /proc/self/io: every read system call) next to the bytes of its shard.

Targets (issue 14): trainguard's stall <= 1.5 x the staging copy and <= 0.5 x
``dcp.async_save``'s stall; trainguard's load <= 1 x ``dcp.load``.

Run: ``.venv/bin/python bench/sharded_checkpoint.py [--params-gib 1] [--repeat 3] [--dir
/dev/shm]``; ``--quick`` for a smoke run of a small model. Every method's buffers are freed
before the next one; the checkpoints (one per method) live in ``--dir`` until the end.
Prints a table and writes bench/results/sharded_checkpoint.json (``--quick``: not written).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import print_table, write_results
from bench.async_checkpoint import tensors_of

GiB = 1 << 30
SAVE_WORLD = 4
RESHARD_WORLD = 3


def has_load_into() -> bool:
    """True when ``trainguard.checkpoint.load`` takes ``into=`` (sharded checkpoints)."""
    from trainguard.checkpoint import load

    return "into" in inspect.signature(load).parameters


def has_dcp_layer() -> bool:
    return importlib.util.find_spec("trainguard.checkpoint.dcp") is not None


def read_bytes() -> int:
    """Bytes this process read through system calls so far (page-cache hits included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def build(world: int, params_bytes: int) -> tuple[Any, Any]:
    """The FSDP2 model over ``world`` ranks and its Adam optimizer after one step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 4096 if params_bytes >= GiB // 4 else 512
    layers = max(2, round(params_bytes / (width * width * 4)))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        for p in model.parameters():
            p.to_local().uniform_(-0.01, 0.01, generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def local_tensors(state: Any) -> list[Any]:
    """Every tensor of ``state``, DTensors as their local shard."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors_of(state)]


class Timer:
    """Per-rank measurements: ``name -> [seconds per repetition]``, barriers around each."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        import torch.distributed as dist

        dist.barrier()
        started = time.perf_counter()
        value = fn()
        self.add(name, time.perf_counter() - started)
        return value


def bench_copy(timer: Timer, state: Any, repeat: int) -> None:
    import torch

    src = local_tensors(state)
    dst = [torch.empty_like(t) for t in src]
    torch._foreach_copy_(dst, src)  # touched
    for _ in range(repeat):
        timer.run("copy", lambda: torch._foreach_copy_(dst, src))
    dst.clear()


def bench_async(
    timer: Timer, name: str, base: Path, repeat: int, save: Callable[[Path], Any]
) -> str:
    """``repeat`` + 1 saves by ``save(path)`` (returns what has ``result()``); stall: until ``save`` returns, durable: until the future's result. The first
    save (buffers, caches) is not counted; only the last checkpoint is kept."""
    import torch.distributed as dist

    for i in range(repeat + 1):
        path = base / f"{name}{i}"
        dist.barrier()
        started = time.perf_counter()
        future = save(path)
        stall = time.perf_counter() - started
        future.result()
        durable = time.perf_counter() - started
        if i:
            timer.add(f"{name}_stall", stall)
            timer.add(f"{name}_durable", durable)
        del future
        dist.barrier()
        if dist.get_rank() == 0 and i < repeat:
            shutil.rmtree(path)
    return str(base / f"{name}{repeat}")


def bench_dcp_save(timer: Timer, state: Any, base: Path, repeat: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    for i in range(repeat):
        path = base / f"dcp_save{i}"
        timer.run("dcp_save", lambda path=path: dcp.save(state, checkpoint_id=path))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path)


class _Waited:
    """A save whose ``result()`` is the checkpointer's ``wait()`` (committed on every rank)."""

    def __init__(self, ckpt: Any) -> None:
        self._ckpt = ckpt

    def result(self) -> None:
        self._ckpt.wait()


def bench_saves(timer: Timer, state: Any, base: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Every save method in turn, each one's buffers freed before the next; the path of each
    method's last checkpoint (kept for the loads)."""
    import torch.distributed.checkpoint as dcp

    repeat, paths = cfg["repeat"], {}
    if cfg["tg"]:
        from trainguard.checkpoint import AsyncCheckpointer

        with AsyncCheckpointer(commit_timeout=1800, close_timeout=1800) as ckpt:

            def tg_save(path: Path) -> _Waited:
                ckpt.save(state, path)
                return _Waited(ckpt)

            paths["tg"] = bench_async(timer, "tg", base, repeat, tg_save)
    paths["dcp"] = bench_async(
        timer, "dcp_async", base, repeat, lambda p: dcp.async_save(state, checkpoint_id=p)
    )
    bench_dcp_save(timer, state, base, repeat)
    if cfg["tgdcp"]:
        from trainguard.checkpoint.dcp import AsyncStager, StorageWriter

        with StorageWriter(base) as writer, AsyncStager(writer) as stager:
            paths["tgdcp"] = bench_async(
                timer,
                "tgdcp",
                base,
                repeat,
                lambda p: dcp.async_save(
                    state, checkpoint_id=p, storage_writer=writer, async_stager=stager
                ),
            )
    return paths


def bench_loads(timer: Timer, state: Any, paths: dict[str, str], tag: str, repeat: int) -> None:
    """Every load method into ``state`` (this world's sharding), with bytes read and a check
    that each method's result equals ``dcp.load``'s."""
    import torch
    import torch.distributed.checkpoint as dcp

    loaders: dict[str, Callable[[], Any]] = {}
    if "tg" in paths:
        from trainguard.checkpoint import load

        loaders["tg"] = lambda: load(paths["tg"], into=state)
    loaders["dcp"] = lambda: dcp.load(state, checkpoint_id=paths["dcp"])
    if "tgdcp" in paths:
        from trainguard.checkpoint.dcp import StorageReader

        loaders["tgdcp"] = lambda: dcp.load(state, storage_reader=StorageReader(paths["tgdcp"]))
    mine = local_tensors(state)
    timer.add(f"shard_bytes_{tag}", float(sum(t.numel() * t.element_size() for t in mine)))
    reference: list[Any] | None = None
    for name in ("dcp", *(n for n in loaders if n != "dcp")):
        for t in mine:
            t.zero_()
        for _ in range(repeat):
            before = read_bytes()
            timer.run(f"load_{name}_{tag}", loaders[name])
            timer.add(f"read_{name}_{tag}", float(read_bytes() - before))
        mine = local_tensors(state)
        if reference is None:
            reference = [t.clone() for t in mine]
        else:
            same = all(torch.equal(a, b) for a, b in zip(reference, mine, strict=True))
            timer.add(f"equal_{name}_{tag}", float(same))
    del reference


def rank_main(
    rank: int, world: int, port: int, cfg: dict[str, Any], paths: dict[str, str], conn: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=3600))
    timer = Timer()
    try:
        model, opt = build(world, cfg["params_bytes"])
        state = full_state(model, opt)
        base, repeat = Path(cfg["base"]), cfg["repeat"]
        if world == SAVE_WORLD:
            bench_copy(timer, state, repeat)
            paths = bench_saves(timer, state, base, cfg)
        bench_loads(timer, state, paths, f"{world}", repeat)
        conn.send({"values": timer.values, "paths": paths})
    except BaseException as exc:
        conn.send({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, cfg: dict[str, Any], paths: dict[str, str]) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, args=(rank, world, port, cfg, paths, send))
            p.start()
            pipes.append(recv)
            procs.append(p)
        results = [conn.recv() for conn in pipes]
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit("\n".join(errors))
    return results


def slowest_median(results: list[dict[str, Any]], key: str) -> float:
    """Per repetition the slowest rank (the job waits for it), then the median."""
    lists = [r["values"][key] for r in results]
    return statistics.median(max(v[i] for v in lists) for i in range(len(lists[0])))


def per_rank(results: list[dict[str, Any]], key: str) -> list[float]:
    return [max(r["values"][key]) for r in results]


def summarize_run(
    saved: list[dict[str, Any]], resharded: list[dict[str, Any]], cfg: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "params_gib": cfg["params_bytes"] / GiB,
        "state_bytes_per_rank": per_rank(saved, "shard_bytes_4"),
        "repeat": cfg["repeat"],
        "dir": str(Path(cfg["base"]).parent),
        "load_average_before": cfg["load_average"],
    }
    keys = saved[0]["values"].keys()
    for key in keys:
        if key.startswith(("shard_bytes", "read_", "equal_")):
            continue
        row[f"{key}_s"] = slowest_median(saved, key)
    for key in resharded[0]["values"]:
        if key.startswith("load_"):
            row[f"{key}_s"] = slowest_median(resharded, key)
    for results in (saved, resharded):
        for key in results[0]["values"]:
            if key.startswith(("read_", "shard_bytes_")):
                row[key] = per_rank(results, key)
            elif key.startswith("equal_"):
                row[key] = all(v == 1.0 for r in results for v in r["values"][key])
    targets: dict[str, bool] = {}
    for name, label in (("tg", "trainguard"), ("tgdcp", "trainguard.checkpoint.dcp")):
        if f"{name}_stall_s" in row:
            stall = row[f"{name}_stall_s"]
            targets[f"{label} stall <= 1.5 x staging copy"] = stall <= 1.5 * row["copy_s"]
            targets[f"{label} stall <= 0.5 x dcp.async_save stall"] = (
                stall <= 0.5 * row["dcp_async_stall_s"]
            )
    for tag in ("4", "3"):
        if f"load_tg_{tag}_s" in row:
            targets[f"trainguard load ({tag} ranks) <= 1 x dcp.load"] = (
                row[f"load_tg_{tag}_s"] <= row[f"load_dcp_{tag}_s"]
            )
    row["targets"] = targets
    return row


def print_summary(row: dict[str, Any]) -> None:
    def get(key: str) -> Any:
        value = row.get(key)
        return "n/a" if value is None else value

    save_rows = [
        ["staging copy (floor)", get("copy_s"), "", ""],
        ["trainguard AsyncCheckpointer.save", get("tg_stall_s"), get("tg_durable_s"), ""],
        [
            "dcp.async_save (FileSystemWriter)",
            get("dcp_async_stall_s"),
            get("dcp_async_durable_s"),
            "",
        ],
        ["dcp.save", "", get("dcp_save_s"), ""],
        [
            "dcp.async_save + trainguard.checkpoint.dcp",
            get("tgdcp_stall_s"),
            get("tgdcp_durable_s"),
            "",
        ],
    ]
    target = (
        f"<= {1.5 * row['copy_s']:.3g} (1.5 x copy), "
        f"<= {0.5 * row['dcp_async_stall_s']:.3g} (0.5 x dcp.async_save)"
    )
    for i, name in ((1, "tg"), (4, "tgdcp")):
        if f"{name}_stall_s" in row:
            save_rows[i][3] = target
    print_table(
        f"sharded save, {SAVE_WORLD} ranks, {row['params_gib']:.3g} GiB of parameters + Adam "
        f"(seconds; median of {row['repeat']}, slowest rank)",
        ["method", "stall", "durable", "target stall"],
        save_rows,
    )
    load_rows = []
    for tag in ("4", "3"):
        shard = row.get(f"shard_bytes_{tag}", [])
        for name, label in (
            ("tg", "trainguard load(path, into=)"),
            ("dcp", "dcp.load (FileSystemReader)"),
            ("tgdcp", "dcp.load + trainguard StorageReader"),
        ):
            seconds = row.get(f"load_{name}_{tag}_s")
            read = row.get(f"read_{name}_{tag}")
            target = ""
            if name == "tg" and seconds is not None:
                target = f"<= {row[f'load_dcp_{tag}_s']:.3g} (1 x dcp.load)"
            load_rows.append(
                [
                    f"{tag} ranks",
                    label,
                    "n/a" if seconds is None else seconds,
                    "n/a" if read is None else " ".join(f"{b / 2**20:.0f}" for b in read),
                    " ".join(f"{b / 2**20:.0f}" for b in shard),
                    {True: "yes", False: "NO", None: "ref" if name == "dcp" else "n/a"}[
                        row.get(f"equal_{name}_{tag}")
                    ],
                    target,
                ]
            )
    print_table(
        "loads (seconds; MiB read per rank, and MiB of each rank's shard)",
        ["into", "method", "load", "MiB read", "MiB shard", "= dcp.load", "target"],
        load_rows,
    )
    for name, ok in row["targets"].items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-gib", type=float, default=1.0, help="parameters in all (GiB)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 MiB, 1 repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="where the checkpoints are written")
    args = parser.parse_args()
    params_gib = 1 / 32 if args.quick else args.params_gib
    repeat = 1 if args.quick else args.repeat
    # parameters + exp_avg + exp_avg_sq; one checkpoint per method stays until the end, and a
    # staging buffer of the state's size exists while its method runs
    need = 3 * params_gib * GiB * 4
    free = shutil.disk_usage(args.dir).free
    if free < need:
        raise SystemExit(
            f"{args.dir} has {free / GiB:.1f} GiB free, the run needs about {need / GiB:.1f} "
            "GiB: use --dir on a larger file system or a smaller --params-gib"
        )
    base = Path(args.dir) / f"trainguard-bench-sharded-{os.getpid()}"
    base.mkdir(parents=True)
    cfg = {
        "params_bytes": int(params_gib * GiB),
        "repeat": repeat,
        "base": str(base),
        "tg": has_load_into(),
        "tgdcp": has_dcp_layer(),
        "load_average": os.getloadavg()[0],
    }
    if not cfg["tg"]:
        print("trainguard has no load(..., into=) yet: its sharded save/load rows are skipped")
    if not cfg["tgdcp"]:
        print("trainguard.checkpoint.dcp does not exist yet: its rows are skipped")
    try:
        print(f"... {SAVE_WORLD} ranks: saves and loads", flush=True)
        saved = run_world(SAVE_WORLD, cfg, {})
        print(f"... {RESHARD_WORLD} ranks: resharded loads", flush=True)
        resharded = run_world(RESHARD_WORLD, cfg, saved[0]["paths"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    row = summarize_run(saved, resharded, cfg)
    print_summary(row)
    if not args.quick:
        write_results("sharded_checkpoint", {f"{params_gib:g}GiB x {SAVE_WORLD} ranks": row})


if __name__ == "__main__":
    main()
