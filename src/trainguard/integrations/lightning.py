"""PyTorch Lightning: asynchronous checkpoints, local replicated checkpoints, in-process restart.

::

    from trainguard.integrations.lightning import AsyncCheckpointIO, LocalCheckpointCallback

    trainer = L.Trainer(plugins=[AsyncCheckpointIO()],            # ModelCheckpoint, async
                        callbacks=[LocalCheckpointCallback("/dev/shm/ckpt", every_n_steps=50)])
    trainer.fit(model, data)                   # resumes from live state, or the newest local one

Under the in-process restart Wrapper, build a new ``Trainer`` every round with
:class:`RoundStrategy` (DDP over the round's ranks) and pass :func:`release_round` as the
Wrapper's ``finalize``::

    @tr.Wrapper(rank_filter=tr.MaxActiveWorldSize(4), finalize=release_round)
    def train(call):
        trainer = L.Trainer(strategy=RoundStrategy(), callbacks=[LocalCheckpointCallback(...)])
        trainer.fit(model, data)               # resumes at the step of the fault

After a fault, :class:`LocalCheckpointCallback` recovers from live state first (the
survivors' memory, :mod:`trainguard.live`: no step recomputed) and from the newest local
checkpoint when no replica can help.

Importing this module imports Lightning (``pip install 'trainguard[lightning]'``).

Over 400 lines: the checkpoint plugin, the callback (live state, local checkpoints and the
dataloader's position at a resume) and the round's environment and strategy are one
integration, each a short class of hooks Lightning defines.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

from trainguard.checkpoint import AsyncCheckpointer
from trainguard.checkpoint import load as load_checkpoint
from trainguard.errors import ConfigError
from trainguard.integrations._round import (
    LocalSchedule,
    forget_live,
    live_for,
    release_round,
    track,
    untrack,
)

__all__ = [
    "AsyncCheckpointIO",
    "LocalCheckpointCallback",
    "RoundEnvironment",
    "RoundStrategy",
    "release_round",
]

logger = logging.getLogger(__name__)

_IF_BUSY = ("wait", "skip")


def _move(node: Any, location: Any) -> Any:
    """``node`` with every tensor leaf moved as ``torch.load(map_location=location)`` would."""
    if isinstance(node, torch.Tensor):
        if callable(location):
            return location(node, "cpu")
        return node.to(location)
    if isinstance(node, dict):
        return {k: _move(v, location) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_move(v, location) for v in node)
    return node


class AsyncCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` plugin: ``save_checkpoint`` returns after the staging copy.

    Lightning calls :meth:`save_checkpoint` on global rank 0 only (``ModelCheckpoint``,
    ``trainer.save_checkpoint``); the file is written in the background by an
    :class:`~trainguard.checkpoint.AsyncCheckpointer` as one safetensors-compatible file at
    ``path`` (read it with :func:`trainguard.checkpoint.load`, or any safetensors reader).
    :meth:`load_checkpoint` runs on every rank; :meth:`remove_checkpoint` waits for a pending
    save of that path first; :meth:`teardown` (end of ``fit``) waits until every save is durable
    and stops the writer.

    Build it before torch.distributed is initialized (Lightning initializes it inside ``fit``):
    its checkpointer, started here on every rank as a world of one, then writes single files
    with no commit round and never binds to a round's process group (a checkpointer of the job
    would count parts of every rank). One plugin per
    ``Trainer``: :meth:`teardown` stops it.

    Args:
        pickle: allow leaves JSON cannot hold (a LightningModule's ``hparams`` of arbitrary
            types); loading such a file needs ``allow_pickle`` too, which this plugin passes.
        if_busy: ``"wait"`` (a save waits for the previous one's write) or ``"skip"``.
        **checkpointer: keyword arguments of ``AsyncCheckpointer`` (``fsync``,
            ``staging_threads``, ``close_timeout``, ...).
    """

    def __init__(self, *, pickle: bool = False, if_busy: str = "wait", **checkpointer: Any):
        if if_busy not in _IF_BUSY:
            raise ConfigError(f"if_busy={if_busy!r}; use one of {_IF_BUSY}")
        if "store" in checkpointer or "rank" in checkpointer or "world_size" in checkpointer:
            raise ConfigError("AsyncCheckpointIO writes on global rank 0 only: pass no store/rank")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise ConfigError(
                "build AsyncCheckpointIO() before torch.distributed is initialized (Lightning "
                "initializes it in fit(); under the Wrapper, use RoundStrategy() and let it)"
            )
        self.pickle = pickle
        self.if_busy = if_busy
        self._options = checkpointer
        # a world of one: built before torch.distributed, a checkpointer otherwise binds to the
        # job's default group at its first save after init_process_group (every rank's part)
        single = AsyncCheckpointer(rank=0, world_size=1, **checkpointer)
        self._checkpointer: AsyncCheckpointer | None = track(single)

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        """The checkpointer; raises :class:`ConfigError` after :meth:`teardown`."""
        if self._checkpointer is None:
            raise ConfigError("this AsyncCheckpointIO was torn down; build a new one per Trainer")
        return self._checkpointer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.checkpointer.save(checkpoint, path, if_busy=self.if_busy, pickle=self.pickle)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = os.fspath(path)
        if self._checkpointer is not None:
            self._checkpointer.wait()  # a save of this path may still be pending
        state = load_checkpoint(path, allow_pickle=self.pickle and not weights_only)
        if not isinstance(state, dict):
            raise ConfigError(f"{path} holds a {type(state).__name__}, not a Lightning checkpoint")
        return _move(state, map_location) if map_location is not None else state

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        if self._checkpointer is not None:
            self._checkpointer.wait()  # never remove a file a pending save is writing
        if os.path.isfile(path):
            os.remove(path)
            logger.debug("removed checkpoint %s", path)

    def teardown(self) -> None:
        """Wait until every save is durable, then stop the writer (Lightning: end of ``fit``)."""
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            untrack(checkpointer)
            checkpointer.close()


class LocalCheckpointCallback(LocalSchedule, pl.Callback):
    """Live-state recovery and local replicated checkpoints every ``every_n_steps`` optimizer
    steps; resume from them.

    Protocol (every rank runs the same callbacks, as Lightning does):

    - ``setup`` of ``fit`` (torch.distributed is up then; a collective) first recovers from
      live state (``live``, the default): the ranks agree on the newest step an untorn rank
      completed, ranks behind (a spare, a respawned process, a torn update) receive it from a
      replica, checksummed, and nothing is recomputed. When no replica can help (a first
      start, every rank torn) it opens a :class:`~trainguard.checkpoint.LocalCheckpointManager`
      under ``root``, finds the newest iteration every rank can recover and loads this rank's
      part. Lightning then restores the model, the optimizers, the loops and the callbacks from
      it, as from ``fit(ckpt_path=...)``; an explicit ``ckpt_path`` wins (Lightning loads it
      over ours). :attr:`resumed_from` is the step, :attr:`resumed_source` ``"live"``,
      ``"local"`` or None.
    - ``on_train_start`` of a resume that stopped mid-epoch: a dataloader without
      ``state_dict``/``load_state_dict`` (which Lightning restarts at the epoch's first batch)
      is advanced past the batches the epoch already consumed (they are loaded and dropped),
      so the next batch is the one the fault-free run would train on.
    - Each optimizer update (``on_before_optimizer_step`` to ``on_train_batch_end``, or to
      ``on_train_epoch_end`` for an epoch's last batch) is one ``live.update``: a fault inside
      it leaves this rank torn (it receives the state). At its end the callback keeps a
      reference to the step's Lightning checkpoint (``dump_checkpoint``; no tensor is copied).
    - After every ``every_n_steps``-th step every rank saves that checkpoint (rank-local state
      included) as its part; the call returns after the staging copy, writing and replication
      run in the background. A step that ends an epoch is saved at the epoch's end
      (``on_train_epoch_end``): Lightning 2.6 resumes from a save made in the last batch's
      ``on_train_batch_end`` but then counts the next epoch wrongly.
    - ``teardown`` waits until the last save is durable with all its copies, then closes the
      manager. After a fault, :func:`release_round` (the Wrapper's ``finalize``) closes it.

    Args: those of :class:`~trainguard.integrations._round.LocalSchedule` (``root``,
    ``every_n_steps`` counted in ``trainer.global_step``, ``replication``, ``keep``,
    ``timeout``, other ``LocalCheckpointManager`` arguments), and:

    - ``live``: recover from live state first (default True; False: local checkpoints only).
      The live state of ``root`` lives in this process across restart rounds (build the
      callback anew every round with the same ``root``). The update is marked without the
      round's ``call.atomic()`` (it spans hooks; a fault inside would leave the section open).
      Every rank must train the same replicated model (DDP): a spare receives a replica's
      state. Without a process group (one process, no DDP) ``setup`` turns it off. Random states are not part of it (nor of Lightning's checkpoint).
    - ``pickle``: allow leaves JSON cannot hold (arbitrary ``hparams``); loading allows it too.
      Live state travels without pickle: ``pickle=True`` needs ``live=False``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every_n_steps: int,
        *,
        live: bool = True,
        pickle: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(root, every_n_steps, **options)
        if live and pickle:
            raise ConfigError("live state travels without pickle: pass live=False with pickle=True")
        self.live = bool(live)
        self.pickle = pickle
        #: where ``setup`` found the state: "live", "local" or None (a fresh start)
        self.resumed_source: str | None = None
        self._update: Any = None
        self._skip: int | None = None  # batches skipped at the resume, until the first batch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.manager is not None:
            raise ConfigError("a LocalCheckpointCallback serves one fit; build a new one")
        dist = torch.distributed
        if self.live and not (dist.is_available() and dist.is_initialized()):
            self.live = False  # one process, no group: no replica to recover from
            logger.info("no process group: resuming from local checkpoints only")
        checkpoint, found, source = self._recovered()
        self._open()  # every rank together, whichever source
        if checkpoint is None or found is None:
            return
        # what fit(ckpt_path=...) would have loaded: Lightning restores everything from it
        trainer._checkpoint_connector._loaded_checkpoint = checkpoint
        self.resumed_from = self._saved = found
        self.resumed_source = source

    def _recovered(self) -> tuple[dict[str, Any] | None, int | None, str | None]:
        """(this rank's checkpoint, its step, "live" or "local"), or Nones on a fresh start."""
        if self.live:
            live, captured = live_for(self.root)
            got = live.recover()
            if got.live and captured.part is not None:
                logger.info("resuming from live state at step %d", got.step)
                return captured.part, got.step, "live"
        manager = self._open()
        found = manager.find_latest()
        if self.live:
            live.restored(found or 0)
        if found is None:
            return None, None, None
        logger.info("resuming from local checkpoint of step %d (%s)", found, manager.last_load)
        return manager.load(found, allow_pickle=self.pickle), found, "local"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resumed_from is None or trainer.ckpt_path is not None:
            return
        progress: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # as loaded
        consumed, total = progress.processed, trainer.num_training_batches
        combined = trainer.fit_loop._combined_loader
        if not 0 < consumed < total or combined is None:
            return  # resumed at an epoch's end (or nothing to skip)
        loaders = combined.flattened
        if all(callable(getattr(dl, "load_state_dict", None)) for dl in loaders):
            return  # stateful: Lightning restores their position itself
        epochs: Any = trainer.fit_loop.epoch_progress.current
        epoch = int(epochs.processed)
        for dl in loaders:  # the order a shuffling sampler yields depends on the epoch
            for sampler in (getattr(dl, "sampler", None), getattr(dl, "batch_sampler", None)):
                if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(epoch)
        for _ in range(consumed):
            next(combined)
        self._skip = consumed
        logger.info(
            "skipped the %d batches epoch %d had consumed before the fault", consumed, epoch
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        skip, self._skip = self._skip, None
        if skip is not None and batch_idx != skip:
            raise RuntimeError(
                f"resumed at batch {batch_idx} of the epoch after skipping {skip}: Lightning's "
                "loop state and the dataloader disagree"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.live and self._update is None:  # the update of this step: torn until its end
            self._update = live_for(self.root)[0].update(trainer.global_step)
            self._update.__enter__()

    def _step_done(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The step's checkpoint, recorded as the live state and the update ended (live)."""
        if not self.live:
            return None
        part = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        live_for(self.root)[1].part = part
        update, self._update = self._update, None
        if update is not None:
            update.__exit__(None, None, None)  # the state is whole at trainer.global_step
        return part

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # recorded at the epoch's end: a resume from there starts the next epoch cleanly
        part = self._step_done(trainer)
        step = trainer.global_step
        if self.manager is None or step % self.every_n_steps or step <= self._saved:
            return
        self._save(trainer, step, part)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        part = self._step_done(trainer)
        step = trainer.global_step
        if self.manager is not None and step % self.every_n_steps == 0 and step > self._saved:
            self._save(trainer, step, part)

    def _save(self, trainer: pl.Trainer, step: int, part: dict[str, Any] | None) -> None:
        assert self.manager is not None
        if part is None:
            part = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.manager.save(part, step, pickle=self.pickle)
        self._saved = step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        manager, self.manager = self.manager, None
        if not trainer.interrupted:
            forget_live(self.root)  # the training ended: nothing left to recover
        if manager is None:
            return
        untrack(manager)
        if trainer.interrupted:  # a fault: peers may be gone, do not wait for them
            track(manager)  # release_round closes it
            return
        manager.wait()
        manager.close()


class RoundEnvironment(ClusterEnvironment):
    """Lightning cluster environment of one restart round (or of torchrun, ``trainguard launch``).

    Reads the job's shape from the variables the Wrapper sets each round (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), every time it is asked:
    the processes exist already, Lightning starts none.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return False  # chosen explicitly, never detected

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def set_world_size(self, size: int) -> None:
        pass  # the job decides it

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def set_global_rank(self, rank: int) -> None:
        pass  # the job decides it

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", "0"))


class RoundStrategy(DDPStrategy):
    """DDP over the processes of the round: one device per process, sampler over the world.

    ``Trainer(strategy=RoundStrategy(), ...)`` needs no ``devices``/``num_nodes``: the world
    is the round's (``WORLD_SIZE``), and this process trains on ``cuda:LOCAL_RANK`` when CUDA is
    available, else on the CPU (backend ``nccl`` or ``gloo`` unless
    ``process_group_backend`` is given). Lightning initializes the process group in ``fit``
    from :class:`RoundEnvironment`; :func:`release_round` destroys it. Other keyword
    arguments are ``DDPStrategy``'s.
    """

    def __init__(self, **kwargs: Any) -> None:
        if "cluster_environment" in kwargs or "parallel_devices" in kwargs:
            raise ConfigError("RoundStrategy sets cluster_environment and parallel_devices itself")
        env = RoundEnvironment()
        if torch.cuda.is_available():
            device = torch.device("cuda", env.local_rank() % torch.cuda.device_count())
            kwargs.setdefault("process_group_backend", "nccl")
        else:
            device = torch.device("cpu")
            kwargs.setdefault("process_group_backend", "gloo")
        kwargs.setdefault("accelerator", None)
        super().__init__(cluster_environment=env, parallel_devices=[device], **kwargs)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}
