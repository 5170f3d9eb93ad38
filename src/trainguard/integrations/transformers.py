"""Hugging Face ``Trainer``: local replicated checkpoints that never block the step; resume.

::

    from trainguard.integrations.transformers import TrainguardCallback

    callback = TrainguardCallback("/dev/shm/ckpt", every_n_steps=50)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume())   # None on a fresh start

Under the in-process restart Wrapper, call :func:`new_round` first in the wrapped function
(accelerate keeps the previous round's process state otherwise), build ``TrainingArguments``
and the ``Trainer`` every round and pass :func:`release_round` as the Wrapper's ``finalize``.

Importing this module imports transformers (``pip install 'trainguard[transformers]'``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
from typing import Any

import numpy
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.integrations._round import LocalSchedule, release_round, untrack

__all__ = ["TrainguardCallback", "new_round", "release_round"]

logger = logging.getLogger(__name__)

# the names the Trainer reads when it resumes from a checkpoint directory
_TRAINER_STATE = "trainer_state.json"
_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"


def new_round() -> None:
    """Forget accelerate's process state (rank, world, device) of an earlier restart round.

    Call it in the wrapped function before building ``TrainingArguments``: accelerate keeps one
    state per process, which would still describe the previous round's process group.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _rng_state() -> dict[str, Any]:
    """This process's random states, as tensors and plain values (no pickle needed)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(numpy.asarray(keys).astype(numpy.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _trainer_rng(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (from :func:`_rng_state`) in the layout of the Trainer's ``rng_state*.pth``."""
    py, np_ = saved["python"], saved["numpy"]
    keys = np_["keys"].numpy().astype(numpy.uint32)
    out: dict[str, Any] = {
        "python": (py["version"], tuple(int(v) for v in py["mt"].tolist()), py["gauss"]),
        "numpy": (np_["kind"], keys, np_["pos"], np_["has_gauss"], np_["cached"]),
        "cpu": saved["cpu"],
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out


class TrainguardCallback(LocalSchedule, TrainerCallback):
    """Save the training state as local replicated checkpoints every ``every_n_steps`` steps.

    Protocol (every rank of the job, as the Trainer runs callbacks on every rank):

    - :meth:`resume` (every rank together, after ``TrainingArguments`` set up torch.distributed
      and before ``trainer.train``) opens the :class:`~trainguard.checkpoint.LocalCheckpointManager`,
      finds the newest iteration every rank can recover, loads this rank's part and lays it out
      as a Trainer checkpoint directory under ``root``; pass what it returns to
      ``trainer.train(resume_from_checkpoint=...)`` (None: nothing to resume).
    - ``on_step_end``, every ``every_n_steps`` steps: every rank saves the model, optimizer and
      scheduler states, the ``TrainerState`` and its random states as its part. The call
      returns after the staging copy; writing and replication run in the background.
    - ``on_train_end`` waits until the last save is durable with all its copies and closes the
      manager. After a fault, :func:`release_round` (the Wrapper's ``finalize``) closes it.

    Args: those of :class:`~trainguard.integrations._round.LocalSchedule` (``root``,
    ``every_n_steps`` counted in ``state.global_step``, ``replication``, ``keep``, ``timeout``,
    other ``LocalCheckpointManager`` arguments).
    """

    def resume(self) -> str | None:
        """A Trainer checkpoint directory of the newest local iteration, or None; every rank."""
        manager = self._open()
        found = manager.find_latest()
        if found is None:
            return None
        part = manager.load(found)
        where = os.path.join(self.root, "resume")
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where, mode=0o700)
        with open(os.path.join(where, _TRAINER_STATE), "w") as f:
            f.write(part["trainer_state"])
        torch.save(part["model"], os.path.join(where, _WEIGHTS))
        torch.save(part["optimizer"], os.path.join(where, _OPTIMIZER))
        if part.get("scheduler") is not None:
            torch.save(part["scheduler"], os.path.join(where, _SCHEDULER))
        rank, world = manager.rank, manager.world_size
        name = f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth"
        torch.save(_trainer_rng(part["rng"]), os.path.join(where, name))
        self.resumed_from = self._saved = found
        logger.info("resuming from local checkpoint of step %d (%s)", found, manager.last_load)
        return where

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = state.global_step
        if step % self.every_n_steps or step <= self._saved:
            return
        model, optimizer = kwargs["model"], kwargs["optimizer"]
        scheduler = kwargs.get("lr_scheduler")
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        fields["stateful_callbacks"] = {}  # callback objects; the Trainer rebuilds them
        part = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "trainer_state": json.dumps(fields, sort_keys=True),
            "rng": _rng_state(),
        }
        self._open().save(part, step)
        self._saved = step

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait until the last save is durable everywhere and close the manager (every rank)."""
        manager, self.manager = self.manager, None
        if manager is not None:
            untrack(manager)
            manager.wait()
            manager.close()
