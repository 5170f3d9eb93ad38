"""Rank function of the Lightning tests: ``trainer.fit`` under the Wrapper, 2 active ranks + a spare.

Every round builds a new Trainer with :class:`RoundStrategy` (DDP over the round's gloo group),
:class:`LocalCheckpointCallback` (every epoch: 4 steps, pairs replicate each other) and
:class:`AsyncCheckpointIO` behind a ``ModelCheckpoint``. The faulty run raises on process 0 at
step 6 of round 0 (resume from step 4) and SIGKILLs process 1 at step 10 of round 1 (the
spare, process 2, takes its rank; resume from step 8). The reference is the same function,
under the same Wrapper, without faults. Module level, so spawned ranks import it.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

import trainguard.restart as tr

STEPS = 16  # 4 epochs of 4 steps: 16 samples, batch 2 per rank, 2 ranks
EVERY = 4
RAISE_AT = (0, 0, 6)  # (round, process, step)
KILL_AT = (1, 1, 10)
TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 90,
    "completion_timeout": 90,
    "soft_timeout": 60.0,
    "hard_timeout": 90.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 30.0,
    "max_rounds": 4,
}


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


class _Job:
    """The wrapped function, with this process's memory across rounds."""

    def __init__(self, out: Path, faults: bool) -> None:
        self.out = out
        self.faults = faults
        self.rounds: list[dict[str, Any]] = []

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
        )
        job = self

        class Probe(Callback):
            def on_train_start(self, trainer: Any, *_: Any) -> None:
                job.rounds[-1]["resumed"] = local.resumed_from

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


def lightning_job(out: str, ports: tuple[int, int]) -> dict[str, Any]:
    """One process: the reference run, then the run with faults (each a job of its own, on a
    store port of its own); both results and rounds."""
    torch.set_num_threads(1)
    os.environ["TG_PROCESS"] = os.environ["RANK"]
    from trainguard.integrations.lightning import release_round

    results = {}
    for (name, faults), port in zip((("reference", False), ("faulty", True)), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        path = Path(out) / name
        path.mkdir(exist_ok=True)
        job = _Job(path, faults)
        options = {**TIMEOUTS, "finalize": release_round}
        options.update(rank_filter=tr.MaxActiveWorldSize(2), rank_assignment=tr.FillGaps())
        final = tr.Wrapper(**options)(job)()
        release_round(strict=True)
        results[name] = {"final": final, "rounds": job.rounds}
    results["threads"] = [t.name for t in threading.enumerate()]
    return results
