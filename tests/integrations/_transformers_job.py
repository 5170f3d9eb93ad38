"""Rank function of the Hugging Face Trainer tests: ``trainer.train`` under the Wrapper.

A GPT-2 built from a tiny config (no download), 2 active ranks and a spare, DDP over gloo;
every round builds new ``TrainingArguments`` and a new ``Trainer`` with
:class:`TrainguardCallback` (every 4 steps = one epoch; pairs replicate each other). The faulty
run raises on process 0 at step 6 of round 0 (resume from step 4) and SIGKILLs process 1 at step
10 of round 1 (the spare takes its rank; resume from step 8). The reference is the same
function under the same Wrapper without faults. Module level, so spawned ranks import it.
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


def tiny_gpt2() -> Any:
    """GPT-2 with 2 layers of width 32 from a config (no download, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: Path, **extra: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": str(out / "hf"),
        "per_device_train_batch_size": 2,
        "num_train_epochs": STEPS // EVERY,
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "ddp_backend": "gloo",
        "seed": 0,
        "disable_tqdm": True,
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(**{**options, **extra})


class _Job(JobBase):
    """The wrapped function, with this process's memory across rounds."""

    def __call__(self, call: tr.CallWrapper) -> dict[str, Any]:
        from transformers import Trainer, TrainerCallback

        from trainguard.checkpoint import CliqueReplication
        from trainguard.integrations.transformers import TrainguardCallback, new_round

        new_round()
        args = arguments(self.out)  # accelerate joins the round's process group here
        callback = TrainguardCallback(
            self.out / f"local{os.environ['TG_PROCESS']}",
            every_n_steps=EVERY,
            replication=CliqueReplication(2, jump=1),
            timeout=60,
            live=os.environ.get("TG_TEST_LIVE", "1") == "1",
        )
        job = self

        class Faults(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                where = (call.round, int(os.environ["TG_PROCESS"]), state.global_step)
                if not job.faults:
                    return
                if where == RAISE_AT:
                    raise RuntimeError("injected fault in a Trainer step")
                if where == KILL_AT:
                    assert callback.manager is not None
                    callback.manager.wait()  # step 8 replicated before the kill
                    (job.out / "killed").write_text("1")
                    os.kill(os.getpid(), signal.SIGKILL)

        model = tiny_gpt2()
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset(), callbacks=[callback, Faults()]
        )
        self.rounds.append({"round": call.round, "rank": call.rank})
        resume = callback.resume()
        self.rounds[-1]["resumed"] = callback.resumed_from
        self.rounds[-1]["source"] = callback.resumed_source
        trainer.train(resume_from_checkpoint=resume)
        self.rounds[-1]["step"] = trainer.state.global_step
        return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def transformers_job(out: str, ports: tuple[int, int]) -> dict[str, Any]:
    """One process: the reference run, then the run with faults (see ``run_both``)."""
    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    return run_both(_Job, out, ports)  # type: ignore[no-any-return]
