"""`trainguard ckpt show|verify` on sharded (DTensor) checkpoints saved by 4 real ranks, and on
crafted file sets with a missing part and with an overlapping chunk."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from trainguard.cli import main

Cli = Callable[..., subprocess.CompletedProcess[str]]


def _four_rank_saves(root: str) -> None:
    """Two checkpoints of the same [7, 5] tensor: ``flat`` sharded over a 1-D mesh of 4 (rows
    0-1, 2-3, 4-5, 6), and ``grid`` over a 2x2 mesh as (Shard(0), Replicate()) (rows 0-3 and
    4-6, each replica written once); and ``flat``'s state as local checkpoint iteration 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainguard.checkpoint import AsyncCheckpointer, CliqueReplication, LocalCheckpointManager

    dist.init_process_group("gloo")
    try:
        full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
        flat = init_device_mesh("cpu", (4,))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with AsyncCheckpointer() as ckpt:
            state = {
                "model": {
                    "w": distribute_tensor(full, flat, [Shard(0)]),
                    "b": distribute_tensor(torch.ones(3), flat, [Replicate()]),
                },
                "step": torch.tensor(3),
            }
            ckpt.save(state, f"{root}/flat")
            grid_state = {
                "model": {
                    "w": distribute_tensor(full, grid, [Shard(0), Replicate()]),
                    "b": distribute_tensor(torch.ones(3), grid, [Replicate(), Replicate()]),
                },
                "step": torch.tensor(3),
            }
            ckpt.save(grid_state, f"{root}/grid")
            ckpt.wait()
        replication = CliqueReplication(2, jump=1)  # node0 keeps owners 0 and 1, node2 2 and 3
        with LocalCheckpointManager(
            f"{root}/local/node{dist.get_rank()}", replication=replication
        ) as mgr:
            mgr.save(state, 1)
            mgr.wait()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    for r in run_ranks(_four_rank_saves, 4, args=(str(root),), timeout=120):
        r.get()
    shutil.copytree(root / "flat", root / "missing")
    (root / "missing" / "rank00002.safetensors").unlink()  # rows 4-5 of w are nowhere
    # grid's rank 0 holds rows 0-3: with flat's rank 1 (rows 2-3) those are held twice
    shutil.copytree(root / "flat", root / "overlap")
    shutil.copy(root / "grid" / "rank00000.safetensors", root / "overlap" / "rank00000.safetensors")
    return root


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``trainguard ckpt ARGS`` run in this process (torch is imported once, not per call)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        code = main(["ckpt", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["trainguard", "ckpt", *args], code, out.out, out.err)

    return run


def test_show_lists_sharded_tensors_and_their_chunks(root: Path, cli: Cli) -> None:
    out = cli("show", str(root / "flat"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    w = next(line for line in lines if line.split()[:1] == ["model.w"])
    assert "float32[7, 5]" in w and "sharded: 4 chunks in 4 files" in w and "S0" in w, w
    b = next(line for line in lines if line.split()[:1] == ["model.b"])
    assert "float32[3]" in b and "1 chunk in 1 file" in b and "R" in b, b
    chunks = lines[lines.index(w) + 1 : lines.index(w) + 5]
    assert [c.split()[0] for c in chunks] == [f"rank0000{i}.safetensors" for i in range(4)]
    assert "offsets [2, 0]" in chunks[1] and "sizes [2, 5]" in chunks[1], chunks
    assert "offsets [6, 0]" in chunks[3] and "sizes [1, 5]" in chunks[3], chunks
    assert any(line.split()[:1] == ["step"] for line in lines), out.stdout  # plain leaves too
    out = cli("show", str(root / "grid"))
    assert out.returncode == 0, out.stderr
    w = next(line for line in out.stdout.splitlines() if line.split()[:1] == ["model.w"])
    assert "sharded: 2 chunks in 2 files" in w and "mesh [2, 2]" in w and "S0, R" in w, w


def test_verify_checks_that_chunks_cover_every_tensor_once(root: Path, cli: Cli) -> None:
    for name in ("flat", "grid"):
        out = cli("verify", str(root / name))
        assert out.returncode == 0, out.stdout + out.stderr
    out = cli("verify", str(root / "missing"))
    assert out.returncode == 1, out.stdout
    fail = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 2, out.stdout
    assert fail[0].endswith("rank00002.safetensors is missing (the checkpoint has 4 ranks)")
    assert "state['model']['w']: its chunks cover 25 of its 35 elements" in fail[1]
    assert fail[1].endswith("no chunk holds offsets [4, 0] sizes [2, 5]"), fail[1]
    out = cli("verify", str(root / "overlap"))
    assert out.returncode == 1, out.stdout
    fail = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1, out.stdout
    assert fail[0].endswith(
        "state['model']['w']: the chunks at offsets (0, 0) (part 0) and (2, 0) (part 1) "
        "overlap at offsets (2, 0) sizes (2, 5)"
    ), fail[0]


def test_local_iterations_are_checked_where_every_owner_is_present(
    root: Path, cli: Cli, tmp_path: Path
) -> None:
    node0 = root / "local" / "node0"
    out = cli("verify", str(node0))  # owners 0 and 1 only: their copies, no coverage check
    assert out.returncode == 0, out.stdout + out.stderr
    merged = tmp_path / "iter_000000000001"
    shutil.copytree(node0 / "iter_000000000001", merged)
    for copy in (root / "local" / "node2" / "iter_000000000001").iterdir():
        shutil.copy(copy, merged / copy.name)
    out = cli("show", str(merged))
    assert out.returncode == 0, out.stderr
    w = next(line for line in out.stdout.splitlines() if line.split()[:1] == ["model.w"])
    assert "sharded: 4 chunks in 4 files" in w, out.stdout
    assert cli("verify", str(merged)).returncode == 0
    lost = next(merged.glob("owner00003.*"))  # owner 3's part replaced by owner 2's
    shutil.copy(merged / "owner00002.h00002.safetensors", lost)
    out = cli("verify", str(merged))
    assert out.returncode == 1, out.stdout
    fail = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert fail == [
        "state['model']['w']: the chunks at offsets (4, 0) (part 2) and (4, 0) (part 3) overlap "
        "at offsets (4, 0) sizes (2, 5)",
        "state['model']['w']: no chunk holds offsets [6, 0] sizes [1, 5]",
    ], out.stdout
