"""Every CUDA/NCCL path of trainguard on this machine's GPUs, in under 10 minutes.

``make gpu-check``. Each check runs in a process of its own (bench/_gpu_jobs.py) with a time
limit, so a hang or a crash fails that check only:

- ``staging``: the async and the local checkpointer save 512 MiB of CUDA tensors (pinned
  staging buffers, the copy stream): the save stall against a plain ``.cpu()`` copy, and the
  loaded tensors compared with the saved ones;
- ``dcp``: ``torch.distributed.checkpoint`` save and load of CUDA tensors through
  trainguard's StorageWriter/StorageReader;
- ``nccl demo``: 2 processes, one NCCL all_reduce (needs 2 GPUs);
- ``nccl restart: exception / hang / kill``: the restart Wrapper over NCCL, one GPU per active
  rank and a spare; rank 1 raises, hangs in a collective that no other rank enters (the NCCL
  communicators must be aborted), or is SIGKILLed (the spare takes its place); every rank
  must end with the fault-free sum (needs 2 GPUs);
- ``live: exception / kill / corrupted transfer``: a model and its optimizer on CUDA in a
  ``LiveState`` under the Wrapper over NCCL: an exception recovers with nothing moved, a
  SIGKILL has the spare receive the state over NCCL (device checksums, no host copy), a bit
  flipped by the donor is refused and the round falls back; every rank must end with the
  fault-free parameters, bit for bit (needs 2 GPUs).

Prints one table and writes ``bench/results/gpu_check.json`` (``--results`` elsewhere).
Without a CUDA device it prints ``skipped: no CUDA device`` and exits 0. Downloads nothing:
it needs only what ``make test`` installs. Untested on GPUs until a run on a GPU machine
exists (see docs/compat.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, print_table
from bench._gpu_jobs import KILLS

JOBS = Path(__file__).resolve().parent / "_gpu_jobs.py"
ROOT = JOBS.parent.parent
#: (name, what it runs, GPUs it needs, time limit in seconds); 10 minutes in all at most
CHECKS: tuple[tuple[str, str, int, float], ...] = (
    ("staging", "staging", 1, 100),
    ("dcp", "dcp", 1, 60),
    ("nccl demo", "demo", 2, 45),
    ("nccl restart: exception", "exception", 2, 70),
    ("nccl restart: hang", "hang", 2, 80),
    ("nccl restart: kill", "kill", 2, 80),
    ("live: exception", "live exception", 2, 50),
    ("live: kill, state over NCCL", "live kill", 2, 60),
    ("live: corrupted transfer falls back", "live corrupt", 2, 50),
)


def plan(gpus: int) -> list[dict[str, Any]]:
    """The checks to run with ``gpus`` devices: each with ``skip`` (why not) or None."""
    return [
        {
            "name": name,
            "job": job,
            "timeout": limit,
            "skip": None if gpus >= need else f"needs {need} GPUs, found {gpus}",
        }
        for name, job, need, limit in CHECKS
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single(job: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.json")
        done = subprocess.run(
            [sys.executable, str(JOBS), job, str(out)],
            cwd=ROOT,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode or not out.exists():
            return {"ok": False, "error": done.stderr.decode(errors="replace")[-2000:]}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _ranks(mode: str, gpus: int, timeout: float) -> dict[str, Any]:
    world = 2 if mode == "demo" else min(gpus, 4) + 1  # the wrapper's jobs have a spare
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for r in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOBS), "rank", mode, tmp],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                _, err = p.communicate()
                errors.append(f"pid {p.pid} timed out")
            if p.returncode and not (mode in KILLS and p.returncode == -9):
                errors.append(err.decode(errors="replace")[-1500:])
        found = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    expected = world - 1 if mode in KILLS else world  # the killed rank writes nothing
    ok = not errors and len(found) == expected and all(r.get("ok") for r in found)
    return {"ok": ok, "ranks": found, "errors": errors}


def run(check: dict[str, Any], gpus: int) -> dict[str, Any]:
    start = time.monotonic()
    try:
        if check["job"] in ("staging", "dcp"):
            result = _single(check["job"], check["timeout"])
        else:
            result = _ranks(check["job"], gpus, check["timeout"])
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timed out after {check['timeout']} s"}
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def _detail(name: str, result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return str(result.get("error") or result.get("errors") or "")[:60].replace("\n", " ")
    if name == "staging":
        return (
            f"stall async {result['async_stall_s_2'] * 1e3:.0f} ms, local "
            f"{result['local_stall_s_2'] * 1e3:.0f} ms vs .cpu() "
            f"{result['plain_cpu_copy_s'] * 1e3:.0f} ms ({result['mib']} MiB)"
        )
    if name == "dcp":
        return f"save {result['save_s']:.2f} s, load {result['load_s']:.2f} s"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    import torch

    payload: dict[str, Any] = {
        "benchmark": "gpu_check",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if not torch.cuda.is_available():
        reason = (
            f"skipped: no CUDA device (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'})"
        )
        print(reason)
        payload.update(skipped=True, reason=reason, checks={})
    else:
        gpus = torch.cuda.device_count()
        payload.update(skipped=False, gpus=gpus, device=torch.cuda.get_device_name(0))
        checks: dict[str, Any] = {}
        rows = []
        for check in plan(gpus):
            if check["skip"] is not None:
                checks[check["name"]] = {"ok": None, "skipped": check["skip"]}
                rows.append([check["name"], "skipped", "", check["skip"]])
                continue
            print(f"=== {check['name']}", flush=True)
            result = run(check, gpus)
            checks[check["name"]] = result
            rows.append(
                [
                    check["name"],
                    "ok" if result["ok"] else "FAIL",
                    result["seconds"],
                    _detail(check["name"], result),
                ]
            )
        payload["checks"] = checks
        print_table(
            f"GPU check: {gpus} x {payload['device']}, torch {torch.__version__}",
            ["check", "result", "seconds", "detail"],
            rows,
        )
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results: {args.results}")
    failed = [n for n, c in payload["checks"].items() if c.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
