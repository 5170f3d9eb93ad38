"""Hugging Face ``Trainer``: live-state recovery, local replicated checkpoints that never block
the step; resume.

::

    from trainguard.integrations.transformers import TrainguardCallback

    callback = TrainguardCallback("/dev/shm/ckpt", every_n_steps=50)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume())   # None on a fresh start

Under the in-process restart Wrapper, call :func:`new_round` first in the wrapped function
(accelerate keeps the previous round's process state otherwise), build ``TrainingArguments``
and the ``Trainer`` every round and pass :func:`release_round` as the Wrapper's ``finalize``.
After a fault, :meth:`TrainguardCallback.resume` recovers from live state first (the
survivors' memory, :mod:`trainguard.live`: no step recomputed) and from the newest local
checkpoint when no replica can help.

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

from trainguard.integrations._round import (
    LocalSchedule,
    forget_live,
    live_for,
    release_round,
    untrack,
)

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
        "cpu": saved["cpu"].clone(),  # a state received live may be a view into a buffer
    }
    if "cuda" in saved:
        out["cuda"] = [t.clone() for t in saved["cuda"]]
    return out


class TrainguardCallback(LocalSchedule, TrainerCallback):
    """Save the training state as local replicated checkpoints every ``every_n_steps`` steps.

    Protocol (every rank of the job, as the Trainer runs callbacks on every rank):

    - :meth:`resume` (every rank together, after ``TrainingArguments`` set up torch.distributed
      and before ``trainer.train``; a collective) first recovers from live state (``live``,
      the default): the ranks agree on the newest step an untorn rank completed, ranks behind
      (a spare, a respawned process, a torn update) receive it from a replica, checksummed,
      and nothing is recomputed. When no replica can help (a first start, every rank torn) it
      opens the :class:`~trainguard.checkpoint.LocalCheckpointManager`, finds the newest
      iteration every rank can recover and loads this rank's part. Either way it lays the state
      out as a Trainer checkpoint directory under ``root``; pass what it returns to
      ``trainer.train(resume_from_checkpoint=...)`` (None: nothing to resume).
      :attr:`resumed_source` says which (``"live"``, ``"local"`` or None).
    - Each optimizer update (``on_pre_optimizer_step`` to ``on_step_end``) is marked as one
      ``live.update``: a fault inside it leaves this rank torn (it receives the state).
      ``on_step_end`` keeps a reference to the step's state (model, optimizer and scheduler
      state dicts, ``TrainerState``, random states; no tensor is copied).
    - ``on_step_end``, every ``every_n_steps`` steps: every rank saves the model, optimizer and
      scheduler states, the ``TrainerState`` and its random states as its part. The call
      returns after the staging copy; writing and replication run in the background.
    - ``on_train_end`` waits until the last save is durable with all its copies and closes the
      manager. After a fault, :func:`release_round` (the Wrapper's ``finalize``) closes it.

    Args: those of :class:`~trainguard.integrations._round.LocalSchedule` (``root``,
    ``every_n_steps`` counted in ``state.global_step``, ``replication``, ``keep``, ``timeout``,
    other ``LocalCheckpointManager`` arguments), and:

    - ``live``: recover from live state first (default True; False: local checkpoints only).
      The live state of ``root`` lives in this process across restart rounds (build the
      callback anew every round with the same ``root``). The update is marked without the
      round's ``call.atomic()``: the window spans two hooks, and a fault raised inside it on
      this rank would leave the section open and the restart's abort waiting for it. A fault
      on another rank that lands inside this rank's update tears it; it then receives the
      state from an untorn replica (with every rank torn, the local checkpoint is used).

    Every rank must train the same replicated model (DDP): a spare receives a replica's state.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every_n_steps: int,
        *,
        live: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(root, every_n_steps, **options)
        self.live = bool(live)
        #: where :meth:`resume` found the state: "live", "local" or None (a fresh start)
        self.resumed_source: str | None = None
        self._update: Any = None

    def resume(self) -> str | None:
        """A Trainer checkpoint directory of the newest step every rank can resume from (live
        state first, then the newest local iteration), or None; every rank, together."""
        part, found, source = self._recovered()
        if part is None or found is None:
            return None
        where = os.path.join(self.root, "resume")
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where, mode=0o700)
        with open(os.path.join(where, _TRAINER_STATE), "w") as f:
            f.write(part["trainer_state"])
        torch.save(part["model"], os.path.join(where, _WEIGHTS))
        torch.save(part["optimizer"], os.path.join(where, _OPTIMIZER))
        if part.get("scheduler") is not None:
            torch.save(part["scheduler"], os.path.join(where, _SCHEDULER))
        rank, world = _rank_and_world()
        name = f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth"
        torch.save(_trainer_rng(part["rng"]), os.path.join(where, name))
        self.resumed_from = self._saved = found
        self.resumed_source = source
        return where

    def _recovered(self) -> tuple[dict[str, Any] | None, int | None, str | None]:
        """(this rank's state, its step, "live" or "local"), or Nones on a fresh start."""
        if self.live:
            live, captured = live_for(self.root)
            got = live.recover()
            if got.live and captured.part is not None:
                logger.info("resuming from live state at step %d", got.step)
                return _as_this_rank(captured.part), got.step, "live"
        manager = self._open()
        found = manager.find_latest()
        if self.live:
            live.restored(found or 0)
        if found is None:
            return None, None, None
        logger.info("resuming from local checkpoint of step %d (%s)", found, manager.last_load)
        return manager.load(found), found, "local"

    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.live:  # the update of step global_step: torn until on_step_end
            self._update = live_for(self.root)[0].update(state.global_step)
            self._update.__enter__()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = state.global_step
        part: dict[str, Any] | None = None
        if self.live:
            part = self._part(state, kwargs)
            live_for(self.root)[1].part = part
            update, self._update = self._update, None
            if update is not None:
                update.__exit__(None, None, None)  # the state is whole at `step`
        if step % self.every_n_steps or step <= self._saved:
            return
        self._open().save(part if part is not None else self._part(state, kwargs), step)
        self._saved = step

    @staticmethod
    def _part(state: TrainerState, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The state of the step that just ended, as a local checkpoint holds it."""
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
        return part

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
        forget_live(self.root)  # the training ended: nothing left to recover
        manager, self.manager = self.manager, None
        if manager is not None:
            untrack(manager)
            manager.wait()
            manager.close()


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _as_this_rank(part: dict[str, Any]) -> dict[str, Any]:
    """``part`` (maybe a replica's) with the ``TrainerState`` fields that name this rank."""
    fields = json.loads(part["trainer_state"])
    rank, _ = _rank_and_world()
    fields["is_world_process_zero"] = rank == 0
    fields["is_local_process_zero"] = int(os.environ.get("LOCAL_RANK", rank)) == 0
    return {**part, "trainer_state": json.dumps(fields, sort_keys=True)}
