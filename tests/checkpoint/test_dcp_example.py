"""examples/sharded_dcp.py runs under torchrun on CPU: it checkpoints through
trainguard.checkpoint.dcp and a second run resumes from the newest committed checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sharded_dcp.py"


def _torchrun(root: Path, steps: int) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLE), "--root", str(root), "--steps", str(steps), "--every", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_sharded_dcp_example_saves_and_resumes(tmp_path: Path) -> None:
    first = _torchrun(tmp_path, 4)
    assert "step 3:" in first and "resumed" not in first
    assert f"latest checkpoint: {tmp_path / 'step00003'}" in first
    second = _torchrun(tmp_path, 6)
    assert f"resumed from {tmp_path / 'step00003'} at step 4" in second
    assert f"latest checkpoint: {tmp_path / 'step00005'}" in second
    for step in (1, 3, 5):
        names = sorted(os.listdir(tmp_path / f"step{step:05d}"))
        assert names == [".metadata", "COMMITTED", "rank00000.safetensors", "rank00001.safetensors"]
