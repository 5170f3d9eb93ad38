"""With overwrite=False a save never touches a committed checkpoint: a multi-rank save to a
committed path is refused on every rank, and the checkpoint there still loads bit-exactly, even when a rank fails
that save for a reason of its own. A directory whose save failed (never committed) can be saved
to again."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from tests._dist import run_ranks


def _state(rank: int, step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(1 << 14, generator=g), "rank": rank, "step": step}


def _load(path: str, rank: int) -> object:
    from trainguard.checkpoint import load
    from trainguard.errors import CheckpointError

    try:
        back = load(path, rank=rank)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return _as_sent(back)


def _save_and_wait(ckpt: object, state: object, path: str) -> str | None:
    from trainguard.errors import CheckpointError

    try:
        ckpt.save(state, path)  # type: ignore[attr-defined]
        ckpt.wait()  # type: ignore[attr-defined]
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _resave(root: str) -> dict:
    import torch.distributed as dist

    from trainguard.checkpoint import AsyncCheckpointer

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    committed, failed = f"{root}/step1", f"{root}/step2"
    out: dict = {}
    try:
        with AsyncCheckpointer(commit_timeout=60, overwrite=False, on_error="raise") as ckpt:
            out["first"] = _save_and_wait(ckpt, _state(rank, 1), committed)
            dist.barrier()
            # rank 1 cannot save its state (an object JSON cannot hold, no pickle=True)
            bad = {"w": object()} if rank == 1 else _state(rank, 2)
            out["resave"] = _save_and_wait(ckpt, bad, committed)
            dist.barrier()
            out["loaded"] = _load(committed, rank)
            out["failed"] = _save_and_wait(ckpt, bad, failed)  # never committed...
            dist.barrier()
            out["again"] = _save_and_wait(ckpt, _state(rank, 3), failed)  # ...so reusable
            dist.barrier()
            out["loaded_again"] = _load(failed, rank)
    finally:
        dist.destroy_process_group()
    return out


def _as_sent(state: dict) -> dict:
    return {k: v.numpy().tobytes() if hasattr(v, "numpy") else v for k, v in state.items()}


def test_a_failed_resave_leaves_the_committed_checkpoint_loadable(tmp_path: Path) -> None:
    results = [r.get() for r in run_ranks(_resave, 2, args=(str(tmp_path),), timeout=150)]
    for rank, out in enumerate(results):
        assert out["first"] is None, out
        assert not isinstance(out["loaded"], str), out["loaded"]
        assert out["loaded"] == _as_sent(_state(rank, 1))  # bit-exact
        assert out["resave"] is not None and "already a committed checkpoint" in out["resave"]
        assert out["failed"] is not None
        assert out["again"] is None, out
        assert out["loaded_again"] == _as_sent(_state(rank, 3))
