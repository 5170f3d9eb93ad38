"""bench/gpu_check.py on a machine without CUDA: a clear skip, exit 0, and its JSON; and the
plan of the checks by the number of GPUs (the CPU-side logic; the GPU paths need a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench import gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_skips_clearly_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--results", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("skipped: no CUDA device (torch ")
    payload = json.loads(out.read_text())
    assert payload["skipped"] is True
    assert payload["reason"].startswith("skipped: no CUDA device")
    assert payload["checks"] == {}
    assert payload["torch"] == torch.__version__


def test_the_plan_skips_the_nccl_checks_below_two_gpus() -> None:
    one = {c["name"]: c["skip"] for c in gpu_check.plan(1)}
    assert one["staging"] is None and one["dcp"] is None
    nccl = [n for n in one if n.startswith("nccl")]
    assert len(nccl) == 4
    assert all(one[n] == "needs 2 GPUs, found 1" for n in nccl)
    live = [n for n in one if n.startswith("live")]  # live state over NCCL, CUDA tensors
    assert len(live) == 3 and all(one[n] == "needs 2 GPUs, found 1" for n in live)
    assert all(c["skip"] is None for c in gpu_check.plan(2))
    assert sum(c["timeout"] for c in gpu_check.plan(8)) < 600  # make gpu-check: < 10 min
