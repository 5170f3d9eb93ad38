"""`trainguard ckpt verify` reports what it cannot read under PATH (a directory it may not
list, a link whose target is gone, a FIFO named like a part) as a problem, exit status 1,
never as a tree it verified."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint._craft import file_bytes

pytestmark = pytest.mark.timeout(120)


_SETPRIV = shutil.which("setpriv")
_NO_OVERRIDE = "-dac_override,-dac_read_search"


def _cli(*args: str, obey_modes: bool = False) -> subprocess.CompletedProcess[str]:
    """``trainguard ARGS``; ``obey_modes``: without the capabilities that let root read any
    file (root then meets file modes as their owner does)."""
    prefix = [_SETPRIV or "setpriv", f"--bounding-set={_NO_OVERRIDE}", f"--inh-caps={_NO_OVERRIDE}"]
    return subprocess.run(
        [*(prefix if obey_modes else []), sys.executable, "-m", "trainguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _tree(root: Path) -> Path:
    """``root/ckpt`` with one good checkpoint file in ``ok/`` and a second directory ``more/``."""
    for sub in ("ok", "more"):
        (root / "ckpt" / sub).mkdir(parents=True)
        (root / "ckpt" / sub / "x.safetensors").write_bytes(file_bytes({"w": torch.ones(3)}))
    return root / "ckpt"


def test_a_dangling_link_and_a_fifo_are_problems(tmp_path: Path) -> None:
    ckpt = _tree(tmp_path)
    assert _cli("ckpt", "verify", str(ckpt)).returncode == 0
    (ckpt / "gone").symlink_to(tmp_path / "removed")  # a subdirectory whose target is gone
    os.mkfifo(ckpt / "ok" / "y.safetensors")
    out = _cli("ckpt", "verify", str(ckpt))
    assert out.returncode == 1, out.stdout
    assert f"FAIL {ckpt / 'gone'}: cannot be read (No such file or directory)" in out.stdout
    assert f"FAIL {ckpt / 'ok' / 'y.safetensors'}: not a regular file" in out.stdout
    assert "2 problem(s) in 2 file(s)" in out.stdout


@pytest.mark.skipif(_SETPRIV is None, reason="needs setpriv (util-linux)")
def test_a_directory_that_cannot_be_listed_is_a_problem(tmp_path: Path) -> None:
    ckpt = _tree(tmp_path)
    assert _cli("ckpt", "verify", str(ckpt), obey_modes=True).returncode == 0
    (ckpt / "more").chmod(0)  # nobody may list it, root without DAC override neither
    try:
        out = _cli("ckpt", "verify", str(ckpt), obey_modes=True)
    finally:
        (ckpt / "more").chmod(0o700)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"FAIL {ckpt / 'more'}: cannot be read (Permission denied)" in out.stdout
    assert f"OK   {ckpt / 'ok' / 'x.safetensors'}" in out.stdout
    assert "1 problem(s) in 1 file(s)" in out.stdout
