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
    assert out.stdout.count("FAIL") == 1 and out.stdout.rstrip().endswith(
        "1 problem(s) in 15 file(s); 1 uncommitted save(s) ignored"
    )
    assert f"UNCOMMITTED {root / 'uncommitted'}: no COMMITTED marker" in out.stdout


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


def test_an_uncommitted_save_under_a_root_is_named_and_not_a_problem(
    root: Path, tmp_path: Path
) -> None:
    """A root with committed checkpoints and one save a crash cut short (no marker): verify
    says which save is uncommitted and why, exits 0 when everything committed is sound, and 1
    when the uncommitted save is the checkpoint asked about."""
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    shutil.copytree(root / "multi", ckpts / "step_000050")
    shutil.copytree(root / "uncommitted", ckpts / "step_000100")
    out = _cli("verify", str(ckpts))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout
    assert (
        f"UNCOMMITTED {ckpts / 'step_000100'}: no COMMITTED marker: a save that did not finish"
        in out.stdout
    )
    assert out.stdout.rstrip().endswith("4 file(s) verified; 1 uncommitted save(s) ignored")
    out = _cli("verify", str(ckpts / "step_000100"))
    assert out.returncode == 1
    assert f"FAIL {ckpts / 'step_000100'}: uncommitted, no COMMITTED marker" in out.stdout
    # a damaged part of the uncommitted save is still a problem
    part = next((ckpts / "step_000100").glob("rank00001.*"))
    part.write_bytes(part.read_bytes()[:-100])
    out = _cli("verify", str(ckpts))
    assert out.returncode == 1 and f"FAIL {part}" in out.stdout


@pytest.mark.parametrize("which", ["rank00000", "rank00001"])
def test_show_fails_on_a_truncated_part(root: Path, tmp_path: Path, which: str) -> None:
    """Any part of a multi-rank checkpoint cut short (the first, which show prints, or another)
    makes show fail and name the file and the truncation."""
    copy = tmp_path / "multi"
    shutil.copytree(root / "multi", copy)
    part = next(copy.glob(f"{which}.*"))
    part.write_bytes(part.read_bytes()[:-100])
    out = _cli("show", str(copy))
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith(f"cannot read {part}: "), out.stderr
    assert "truncated: entry " in out.stderr and "the file was cut short" in out.stderr
    assert "Traceback" not in out.stderr


def test_show_fails_cleanly_on_a_truncated_torch_file(root: Path, tmp_path: Path) -> None:
    cut = tmp_path / "legacy.pt"
    cut.write_bytes((root / "legacy.pt").read_bytes()[:3000])
    out = _cli("show", str(cut))
    assert out.returncode == 1 and f"cannot read {cut}: " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_ls_of_a_root_of_node_roots_lists_their_iterations(root: Path) -> None:
    """`ckpt ls RUN/local` of the demo: one local root per node under it."""
    out = _cli("ls", str(root / "local"))
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert names == [f"node{n}/iter_0000000000{i}" for n in (0, 1) for i in (10, 20)]
    assert all("local" in line for line in out.stdout.splitlines()[1:])
