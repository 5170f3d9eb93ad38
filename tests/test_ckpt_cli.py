"""`trainguard ckpt ls|verify|show` on good, uncommitted, corrupted and local checkpoints."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from trainguard.checkpoint import AsyncCheckpointer


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "ckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((64, 32), float(step)), "b": torch.arange(32)},
        "step": step,
    }


def _two_rank_save(root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        with AsyncCheckpointer() as ckpt:
            ckpt.save(_state(dist.get_rank()), f"{root}/multi")
    finally:
        dist.destroy_process_group()


def _two_rank_local_save(root: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        replication = CliqueReplication(factor=2, jump=1)
        with LocalCheckpointManager(f"{root}/node{rank}", replication=replication) as mgr:
            for it in (10, 20):
                mgr.save(_state(it + rank), it)
            mgr.wait()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    with AsyncCheckpointer() as ckpt:
        ckpt.save(_state(1), root / "single.safetensors")
        ckpt.save(_state(2), root / "legacy.pt", format="torch")
    for r in run_ranks(_two_rank_save, 2, args=(str(root),), timeout=120):
        r.get()
    for r in run_ranks(_two_rank_local_save, 2, args=(str(root / "local"),), timeout=120):
        r.get()
    shutil.copytree(root / "multi", root / "uncommitted")
    (root / "uncommitted" / "COMMITTED").unlink()
    shutil.copy(root / "single.safetensors", root / "corrupt.safetensors")
    with open(root / "corrupt.safetensors", "r+b") as f:  # flip a byte in the last tensor
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    (root / "README.txt").write_text("not a checkpoint\n")
    return root


def test_ls_lists_kinds_and_status(root: Path) -> None:
    out = _cli("ls", str(root))
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert set(rows) == {
        "corrupt.safetensors",
        "legacy.pt",
        "multi",
        "single.safetensors",
        "uncommitted",
    }
    assert "complete" in rows["single.safetensors"] and "complete" in rows["legacy.pt"]
    assert "corrupt" in rows["corrupt.safetensors"].split()[2]
    assert rows["multi"].split()[1:4] == ["ranks", "committed", "2"]
    assert rows["uncommitted"].split()[1:4] == ["ranks", "uncommitted", "2"]


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("single.safetensors", True),
        ("legacy.pt", True),
        ("multi", True),
        ("uncommitted", False),
        ("corrupt.safetensors", False),
    ],
)
def test_verify_exit_status(root: Path, name: str, ok: bool) -> None:
    out = _cli("verify", str(root / name))
    assert (out.returncode == 0) is ok, out.stdout + out.stderr
    if name == "corrupt.safetensors":
        assert "checksum mismatch in tensor 'model." in out.stdout
    if name == "uncommitted":
        assert "no COMMITTED marker" in out.stdout


def test_show_lists_keys_dtypes_shapes(root: Path) -> None:
    out = _cli("show", str(root / "single.safetensors"))
    assert out.returncode == 0, out.stderr
    assert "model.w" in out.stdout and "F32" in out.stdout and "[64, 32]" in out.stdout
    out = _cli("show", str(root / "legacy.pt"))
    assert (
        out.returncode == 0 and "model.w" in out.stdout and "torch.float32 [64, 32]" in out.stdout
    )


def test_missing_paths_fail_clearly(tmp_path: Path) -> None:
    for action in ("ls", "verify", "show"):
        out = _cli(action, str(tmp_path / "nothing"))
        assert out.returncode == 1 and out.stderr.strip()


def test_verify_a_whole_root_reports_every_problem(root: Path) -> None:
    out = _cli("verify", str(root))
    assert out.returncode == 1
    assert out.stdout.count("FAIL") == 2 and out.stdout.rstrip().endswith(
        "2 problem(s) in 15 file(s)"
    )


def test_local_root_lists_iterations_and_checks_every_replica(root: Path, tmp_path: Path) -> None:
    out = _cli("ls", str(root / "local" / "node0"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["iter_000000000010", "iter_000000000020"]
    assert all("local" in line and "2 owners, 2 copies" in line for line in lines)
    node = tmp_path / "node1"
    shutil.copytree(root / "local" / "node1", node)
    assert _cli("verify", str(node)).returncode == 0
    replica = next((node / "iter_000000000020").glob("owner00000.*"))  # rank 0's part, held by 1
    with open(replica, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))
    out = _cli("verify", str(node))
    assert out.returncode == 1 and f"FAIL {replica}" in out.stdout
