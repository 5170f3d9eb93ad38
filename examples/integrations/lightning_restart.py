"""Lightning under in-process restart: 2 ranks, one exception, resume from live state.

Run: ``.venv/bin/python examples/integrations/lightning_restart.py``. It starts 2 ranks itself
(gloo on CPU; with torchrun, call ``train()`` in each worker instead). Every round builds a new
Trainer with ``RoundStrategy`` (DDP over the round's ranks), ``LocalCheckpointCallback`` (a local
checkpoint every 4 steps, each rank's part copied to the other rank) and ``AsyncCheckpointIO``
behind ``ModelCheckpoint``. Rank 1 raises at step 6 of round 0; round 1 resumes at step 6 from
live state (nothing recomputed; ``live=False``: at step 4 from the local checkpoint).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from _ranks import start
from lightning.pytorch.callbacks import ModelCheckpoint

import trainguard.restart as tr
from trainguard.checkpoint import CliqueReplication
from trainguard.integrations.lightning import (
    AsyncCheckpointIO,
    LocalCheckpointCallback,
    RoundStrategy,
    release_round,
)


class Regressor(pl.LightningModule):
    def __init__(self, round_: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        )
        self.round = round_

    def training_step(self, batch, batch_idx):
        if self.round == 0 and self.global_rank == 1 and self.global_step == 6:
            raise RuntimeError("simulated fault")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


def train(root: str) -> None:
    @tr.Wrapper(finalize=release_round, max_rounds=3)
    def fit(call: tr.CallWrapper) -> int:
        local = LocalCheckpointCallback(
            f"{root}/local{call.initial_rank}",
            every_n_steps=4,
            replication=CliqueReplication(2, jump=1),
        )
        trainer = pl.Trainer(
            accelerator="cpu", strategy=RoundStrategy(), plugins=[AsyncCheckpointIO()],
            callbacks=[local, ModelCheckpoint(f"{root}/lightning", every_n_train_steps=4)],
            max_epochs=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Regressor(call.round), data())
        print(f"rank {call.rank}: round {call.round} resumed from {local.resumed_source} "
              f"{local.resumed_from}, ended at step {trainer.global_step}", flush=True)  # fmt: skip
        return trainer.global_step

    fit()
    release_round(strict=True)  # the last round's process group


def main() -> None:
    root = start(train, 2, "trainguard-lightning-")
    print("ModelCheckpoint files:", sorted(os.listdir(f"{root}/lightning")))


if __name__ == "__main__":
    main()
