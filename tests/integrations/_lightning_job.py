"""Rank function of the Lightning tests: ``trainer.fit`` under the Wrapper, 2 active ranks + a spare.

Every round builds a new Trainer with :class:`RoundStrategy` (DDP over the round's gloo group),
:class:`LocalCheckpointCallback` (live state, and every epoch: 4 steps, pairs replicate each other) and
:class:`AsyncCheckpointIO` behind a ``ModelCheckpoint``. The faulty run raises on process 0 at
step 6 of round 0 (resume from live state at step 6, or from local checkpoint 4 without live
state) and SIGKILLs process 1 at step 10 of round 1 (the spare, process 2, takes its rank;
resume at step 10, or 8). The reference is the same function,
under the same Wrapper, without faults. Module level, so spawned ranks import it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

import trainguard.restart as tr
from tests.integrations._checks import EVERY, KILL_AT, RAISE_AT, STEPS, JobBase, run_both

__all__ = ["EVERY", "STEPS"]


def _module() -> Any:
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self, faults: bool, out: str) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
            )
            self.faults = faults
            self.out = Path(out)
            self.round = -1

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            where = (self.round, int(os.environ["TG_PROCESS"]), self.global_step)
            if self.faults and where == RAISE_AT:
                raise RuntimeError("injected fault in training_step")
            if self.faults and where == KILL_AT:
                (self.out / "killed").write_text("1")
                os.kill(os.getpid(), signal.SIGKILL)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.05)

    return Regressor


def _data() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g)
    y = torch.randn(16, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


class _Job(JobBase):
    """The wrapped function, with this process's memory across rounds (``live``: the callback's
    live-state recovery, on by default; the environment's ``TG_LIVE=0`` turns it off)."""

    def __call__(self, call: tr.CallWrapper) -> dict[str, Any]:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Callback, ModelCheckpoint

        from trainguard.checkpoint import CliqueReplication
        from trainguard.integrations.lightning import (
            AsyncCheckpointIO,
            LocalCheckpointCallback,
            RoundStrategy,
        )

        local = LocalCheckpointCallback(
            self.out / f"local{os.environ['TG_PROCESS']}",
            every_n_steps=EVERY,
            replication=CliqueReplication(2, jump=1),
            timeout=60,
            live=os.environ.get("TG_LIVE", "1") == "1",
        )
        job = self

        class Probe(Callback):
            def on_train_start(self, trainer: Any, *_: Any) -> None:
                job.rounds[-1]["resumed"] = local.resumed_from
                job.rounds[-1]["source"] = local.resumed_source

            def on_train_batch_end(self, trainer: Any, *_: Any) -> None:  # step 8 replicated

                if job.faults and local.manager is not None and trainer.global_step == 9:
                    local.manager.wait()

        model = _module()(self.faults, str(self.out))
        model.round = call.round
        trainer = pl.Trainer(
            accelerator="cpu",
            strategy=RoundStrategy(),
            plugins=[AsyncCheckpointIO()],
            callbacks=[
                local,
                Probe(),
                ModelCheckpoint(
                    self.out / "lightning",
                    every_n_train_steps=EVERY,
                    save_top_k=2,
                    monitor="step",
                    mode="max",
                    save_last=True,
                ),
            ],
            max_epochs=STEPS // EVERY,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
        )
        self.rounds.append({"round": call.round, "rank": call.rank})
        trainer.fit(model, _data())
        self.rounds[-1]["step"] = trainer.global_step
        return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def lightning_job(out: str, ports: tuple[int, int], live: bool = True) -> dict[str, Any]:
    """One process: the reference run, then the run with faults (see ``run_both``)."""
    torch.set_num_threads(1)
    os.environ["TG_LIVE"] = str(int(live))
    return run_both(_Job, out, ports)  # type: ignore[no-any-return]
