"""PyTorch Lightning: asynchronous checkpoints, local replicated checkpoints, in-process restart.

::

    from trainguard.integrations.lightning import AsyncCheckpointIO, LocalCheckpointCallback

    trainer = L.Trainer(plugins=[AsyncCheckpointIO()],            # ModelCheckpoint, async
                        callbacks=[LocalCheckpointCallback("/dev/shm/ckpt", every_n_steps=50)])
    trainer.fit(model, data)                   # resumes from the newest local checkpoint

Under the in-process restart Wrapper, build a new ``Trainer`` every round with
:class:`RoundStrategy` (DDP over the round's ranks) and pass :func:`release_round` as the
Wrapper's ``finalize``::

    @tr.Wrapper(rank_filter=tr.MaxActiveWorldSize(4), finalize=release_round)
    def train(call):
        trainer = L.Trainer(strategy=RoundStrategy(), callbacks=[LocalCheckpointCallback(...)])
        trainer.fit(model, data)               # resumes where the last local checkpoint was

Importing this module imports Lightning (``pip install 'trainguard[lightning]'``).
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
from trainguard.integrations._round import LocalSchedule, release_round, track, untrack

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
    """Local replicated checkpoints every ``every_n_steps`` optimizer steps; resume from them.

    Protocol (every rank runs the same callbacks, as Lightning does):

    - ``setup`` of ``fit`` opens a :class:`~trainguard.checkpoint.LocalCheckpointManager` under
      ``root`` on every rank (torch.distributed is up then), finds the newest iteration every
      rank can recover and loads this rank's part; Lightning then restores the model, the
      optimizers, the loops and the callbacks from it, as from ``fit(ckpt_path=...)``. An
      explicit ``ckpt_path`` wins (Lightning loads it over the local checkpoint). :attr:`resumed_from` is the step.
    - After every ``every_n_steps``-th step every rank saves the full Lightning checkpoint
      (``trainer.save_checkpoint``'s contents, rank-local state included) as its part; the call
      returns after the staging copy, writing and replication run in the background. A step
      that ends an epoch is saved at the epoch's end (``on_train_epoch_end``): Lightning 2.6
      resumes from a save made in the last batch's ``on_train_batch_end`` but then counts the
      next epoch wrongly.
    - ``teardown`` waits until the last save is durable with all its copies, then closes the
      manager. After a fault, :func:`release_round` (the Wrapper's ``finalize``) closes it.

    A mid-epoch resume is exact only with a resumable (stateful) dataloader, Lightning's rule;
    with ``every_n_steps`` a multiple of the steps per epoch any dataloader resumes exactly.

    Args: those of :class:`~trainguard.integrations._round.LocalSchedule` (``root``,
    ``every_n_steps`` counted in ``trainer.global_step``, ``replication``, ``keep``,
    ``timeout``, other ``LocalCheckpointManager`` arguments), and ``pickle``: allow leaves
    JSON cannot hold (arbitrary ``hparams``); loading allows it too.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every_n_steps: int,
        *,
        pickle: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(root, every_n_steps, **options)
        self.pickle = pickle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.manager is not None:
            raise ConfigError("a LocalCheckpointCallback serves one fit; build a new one")
        manager = self._open()
        found = manager.find_latest()
        if found is None:
            return
        checkpoint = manager.load(found, allow_pickle=self.pickle)
        # what fit(ckpt_path=...) would have loaded: Lightning restores everything from it
        trainer._checkpoint_connector._loaded_checkpoint = checkpoint
        self.resumed_from = found
        self._saved = found
        logger.info("resuming from local checkpoint of step %d (%s)", found, manager.last_load)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if self.manager is None or step % self.every_n_steps or step <= self._saved:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # saved at the epoch's end: a resume from there starts the next epoch cleanly
        self._save(trainer, step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if self.manager is not None and step % self.every_n_steps == 0 and step > self._saved:
            self._save(trainer, step)

    def _save(self, trainer: pl.Trainer, step: int) -> None:
        assert self.manager is not None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.manager.save(checkpoint, step, pickle=self.pickle)
        self._saved = step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        manager, self.manager = self.manager, None
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
