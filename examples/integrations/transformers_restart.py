"""Hugging Face Trainer under in-process restart: 2 ranks, one exception, resume locally.

Run: ``.venv/bin/python examples/integrations/transformers_restart.py``. It starts 2 ranks itself
(gloo on CPU). A GPT-2 built from a tiny config (no download) trains under the Wrapper; every
round calls ``new_round()``, builds ``TrainingArguments`` and a ``Trainer`` with
``TrainguardCallback`` (a local checkpoint every 4 steps, copied to the other rank) and resumes
from ``callback.resume()``. Rank 1 raises at step 6 of round 0; round 1 resumes at step 4.
"""

from __future__ import annotations

import torch
from _ranks import start
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import trainguard.restart as tr
from trainguard.checkpoint import CliqueReplication
from trainguard.integrations.transformers import TrainguardCallback, new_round, release_round


class Fault(TrainerCallback):
    def __init__(self, round_: int, rank: int) -> None:
        self.round, self.rank = round_, rank

    def on_step_end(self, args, state, control, **kwargs):
        if self.round == 0 and self.rank == 1 and state.global_step == 6:
            raise RuntimeError("simulated fault")


def train(root: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (16, 16), generator=g)]

    @tr.Wrapper(finalize=release_round, max_rounds=3)
    def fit(call: tr.CallWrapper) -> int:
        new_round()
        args = TrainingArguments(
            output_dir=f"{root}/hf", per_device_train_batch_size=2, num_train_epochs=4,
            save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
            disable_tqdm=True, logging_strategy="no",
        )  # fmt: skip
        callback = TrainguardCallback(
            f"{root}/local{call.initial_rank}",
            every_n_steps=4,
            replication=CliqueReplication(2, jump=1),
        )
        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        )
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[callback, Fault(call.round, call.rank)])  # fmt: skip
        trainer.train(resume_from_checkpoint=callback.resume())
        print(f"rank {call.rank}: round {call.round} resumed from {callback.resumed_from}, "
              f"ended at step {trainer.state.global_step}", flush=True)  # fmt: skip
        return trainer.state.global_step

    fit()
    release_round(strict=True)  # the last round's process group


if __name__ == "__main__":
    start(train, 2, "trainguard-transformers-")
