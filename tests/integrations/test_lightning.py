"""Lightning with trainguard, real Lightning and real gloo ranks (tests/_dist.py).

``trainer.fit`` under the in-process restart Wrapper (a new Trainer with RoundStrategy every
round) survives an exception raised in ``training_step`` and a SIGKILLed rank replaced by a
spare, resuming from live state at the fault's step (or, with ``live=False``, from
LocalCheckpointCallback's replicated checkpoints), and ends with the weights
of the fault-free run of the same function under the same Wrapper. The reference is that run
and not a plain ``fit``: the resumed rounds must reproduce exactly what the job would have
computed without faults, with the same code and settings. Two active ranks make it bit-exact
without further care: the sum of two gradients does not depend on their order, so DDP's
first-iteration bucket order after a rebuild cannot change it. ModelCheckpoint writes through
AsyncCheckpointIO, whose saves return before the (stopped) writer has written anything.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import free_port, run_ranks
from tests.integrations import _lightning_job as job
from tests.integrations._checks import check_fault_run

pytest.importorskip("lightning")

# Lightning's own notices (torch-pytree deprecations, hints about dataloader workers) are not ours
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("live", [True, False], ids=["live", "local_only"])
def test_fit_under_the_wrapper_survives_an_exception_and_a_sigkill(
    tmp_path: Path, live: bool
) -> None:
    from safetensors import safe_open

    from trainguard.checkpoint import load

    ports = (free_port(), free_port())
    results = run_ranks(job.lightning_job, 3, args=(str(tmp_path), ports, live), timeout=280)
    # live state: both rounds resume where the fault struck, mid-epoch (the dataloader skips
    # the epoch's consumed batches), nothing recomputed; local only: the epoch's checkpoint
    first = check_fault_run(results, tmp_path, job.STEPS, (6, 10) if live else (4, 8))
    source = "live" if live else "local"
    assert [r["source"] for r in first["faulty"]["rounds"]] == [None, source, source]
    spare = results[2].get()
    assert [r["source"] for r in spare["faulty"]["rounds"]] == [source]
    # ModelCheckpoint kept working through AsyncCheckpointIO, in every round, with retention
    saved = sorted(os.listdir(tmp_path / "faulty" / "lightning"))
    assert saved == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"], saved
    last = load(tmp_path / "faulty" / "lightning" / "last.ckpt")
    assert last["global_step"] == job.STEPS
    for key, value in first["faulty"]["final"].items():
        assert torch.equal(last["state_dict"][key], torch.from_numpy(value)), key
    with safe_open(str(tmp_path / "faulty" / "lightning" / "last.ckpt"), "pt") as f:
        assert len(list(f.keys())) >= len(first["faulty"]["final"])  # any safetensors reader


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def _slow_writer_fit(root: Path) -> dict[str, Any]:
    """One process: the writers are SIGSTOPped before the saves of step 2, resumed at step 3."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from trainguard.integrations.lightning import AsyncCheckpointIO, LocalCheckpointCallback

    os.environ["TG_PROCESS"] = "0"
    io = AsyncCheckpointIO()
    local = LocalCheckpointCallback(root / "local", every_n_steps=2)
    seen: dict[str, Any] = {}

    class Stop(Callback):  # runs before `local` saves step 2
        def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
            assert local.manager is not None
            pids = [io.checkpointer.writer_pid, local.manager._writer.pid]
            if trainer.global_step == 2:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                seen["files"] = _files(root)
                trainer.save_checkpoint(root / "step2.ckpt")  # through AsyncCheckpointIO
                seen["weights"] = {k: v.clone() for k, v in module.state_dict().items()}
            if trainer.global_step == 3:  # a whole step ran while nothing could be written
                seen["absent"] = not (root / "step2.ckpt").exists()
                seen["new"] = sorted(set(_files(root)) - set(seen["files"]))
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)

    model = job._module()(False, str(root))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, plugins=[io], callbacks=[Stop(), local],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, job._data())
    return seen


@pytest.mark.timeout(120)
def test_saves_return_after_the_staging_copy_while_the_writer_is_stopped(tmp_path: Path) -> None:
    from trainguard.checkpoint import LocalCheckpointManager, load

    seen = _slow_writer_fit(tmp_path)
    assert seen["absent"], "the save waited for the writer"
    assert not seen["new"], "files were written while the writers were stopped"
    # the snapshot holds the values of the save's moment, not later ones
    step2 = load(tmp_path / "step2.ckpt")
    assert step2["global_step"] == 2
    for key, value in seen["weights"].items():
        assert torch.equal(step2["state_dict"][key], value), key
    with LocalCheckpointManager(tmp_path / "local") as mgr:
        assert mgr.find_latest() == 4
        part = mgr.load(2)
        for key, value in seen["weights"].items():
            assert torch.equal(part["state_dict"][key], value), key
