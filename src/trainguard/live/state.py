"""LiveState: what must survive a fault in memory, the optimizer update's marks, and recovery.

::

    live = LiveState(model=net, optimizer=opt, scheduler=sched)   # once, outside the wrapper

    @trainguard.restart.Wrapper(...)
    def train(call):
        dist.init_process_group("gloo")
        got = live.recover()                    # every rank, first, before any other collective
        if got.fallback:                        # no untorn replica: today's checkpoint path
            first = load_checkpoint_into(net, opt) or 0
            live.restored(first)
        else:
            first = got.step
        for step in range(first, steps):
            loss = forward_backward(step)       # a fault here leaves the state at `step`
            with live.update(step, call):       # inside: torn; after: at step + 1
                opt.step()
                sched.step()

A rank's state is "at step ``s``" when ``s`` updates are done (``s`` is the next step to run).
:meth:`LiveState.recover` is a collective: see :mod:`trainguard.live` for the protocol.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from trainguard.errors import ConfigError
from trainguard.live._outcome import Recovery
from trainguard.live._plan import GroupKey

__all__ = ["Atomic", "LiveState", "Recovery"]

logger = logging.getLogger(__name__)


class Atomic(Protocol):
    """What :meth:`LiveState.update` needs of the round's ``CallWrapper``."""

    def atomic(self) -> contextlib.AbstractContextManager[None]: ...


ReplicaGroup = GroupKey | Callable[[int, int], GroupKey] | None


class LiveState:
    """The state that survives a fault in the memory of the ranks that hold it.

    Args:
        rng: also keep torch's CPU random state (and CUDA's when CUDA is initialized).
        replica_group: which ranks hold the same state: None (every rank: DDP), a key
            (int or str) of this rank's group, or ``f(rank, world_size) -> key`` (HSDP: the
            ranks with the same shard index), called at every :meth:`recover` with the round's
            rank and world size.
        **objects: the objects to keep, by name (``model=``, ``optimizer=``, ``scheduler=``,
            ``loader=``, any name): anything with ``state_dict()`` and ``load_state_dict()``.
            Everything registered must be the same on every rank of a replica group (state that
            differs per rank, such as a data position, must follow from the rank and the step).

    Raises :class:`~trainguard.errors.ConfigError` when nothing is registered, an object lacks
    ``state_dict``/``load_state_dict``, or ``replica_group`` is of another type.
    """

    def __init__(self, *, rng: bool = True, replica_group: ReplicaGroup = None, **objects: Any):
        if not objects:
            raise ConfigError(
                "LiveState() needs the objects to keep: LiveState(model=net, optimizer=opt)"
            )
        for name, obj in objects.items():
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise ConfigError(
                    f"LiveState({name}=...): a {type(obj).__name__} has no state_dict() and "
                    f"load_state_dict(); register objects that have both (a module, an "
                    f"optimizer, a scheduler, a stateful loader)"
                )
        if not (
            replica_group is None
            or callable(replica_group)
            or (isinstance(replica_group, int | str) and not isinstance(replica_group, bool))
        ):
            raise ConfigError(
                f"LiveState(replica_group={replica_group!r}): give None (every rank holds the "
                f"same state), an int or str key, or a function (rank, world_size) -> key"
            )
        self._objects = dict(objects)
        self._rng = rng
        self._replica_group = replica_group
        self._step: int | None = None
        self._torn = False
        self._pending_newest: int | None = None  # a fallback's newest step, until restored()
        #: test hook (see :mod:`trainguard.live._transfer`): corrupts what this rank sends
        self._tamper: Any = None

    @property
    def step(self) -> int | None:
        """The step the state is at (the number of completed updates: the next step to run),
        None while it holds nothing known (before the first update or :meth:`restored`)."""
        return self._step

    @property
    def torn(self) -> bool:
        """Whether an update started and did not finish (the state is neither step)."""
        return self._torn

    @contextlib.contextmanager
    def update(self, step: int, call: Atomic | None = None) -> Iterator[None]:
        """Mark the optimizer update of step ``step`` (wrap ``optimizer.step()`` and the
        scheduler's step in it): inside, the state is torn; after a normal exit it is at
        ``step + 1``. An exception inside leaves it torn.

        Pass the round's ``call`` (:class:`trainguard.restart.CallWrapper`) so that a restart
        does not interrupt a healthy rank in the middle of its update (the abort waits for it,
        as for ``call.atomic()``); without it, a fault on another rank that lands while this
        rank updates tears this rank too. Keep the block local: no collective inside.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"live.update({step!r}): give the step's number, an int >= 0")
        with call.atomic() if call is not None else contextlib.nullcontext():
            self._torn = True
            yield
            self._step = step + 1
            self._torn = False

    def restored(self, step: int) -> None:
        """The caller put the state at ``step`` itself (loaded a checkpoint after a fallback,
        or started fresh at 0): the state is whole again. Emits ``live_restored`` with the
        steps that the fallback recomputes."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"live.restored({step!r}): give the step loaded, an int >= 0")
        newest, self._pending_newest = self._pending_newest, None
        self._step, self._torn = step, False
        recomputed = max(0, newest - step) if newest is not None else 0
        from trainguard import events

        events.emit("live_restored", step=step, newest=newest, recomputed=recomputed)

    def state_dict(self) -> dict[str, Any]:
        """Every registered object's state (and the RNG's), as one nested dict."""
        import torch

        out: dict[str, Any] = {"objects": {n: o.state_dict() for n, o in self._objects.items()}}
        if self._rng:
            rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            out["rng"] = rng
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a state from :meth:`state_dict` (of this rank or a replica) into the objects.
        The state is marked torn first, and stays torn (this rank is no donor) until
        :meth:`restored` says which step it is at: a load that stops half way never leaves a
        record that vouches for what it overwrote."""
        import torch

        self._writing()
        objects = state["objects"]
        missing = sorted(set(self._objects) - set(objects))
        if missing:
            raise ConfigError(
                f"live state lacks {missing}: every rank must register the same names"
            )
        for name, obj in self._objects.items():
            obj.load_state_dict(objects[name])
        rng = state.get("rng")
        if self._rng and rng is not None:
            torch.set_rng_state(rng["cpu"].clone())
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([t.clone() for t in rng["cuda"]])

    def group_key(self, rank: int, world_size: int) -> GroupKey:
        """This rank's replica group key in a round of ``world_size`` ranks."""
        group = self._replica_group
        if group is None:
            return 0
        key = group(rank, world_size) if callable(group) else group
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise ConfigError(
                f"LiveState(replica_group=...) returned {key!r} for rank {rank}; return an "
                f"int or str key"
            )
        return key

    def recover(self, *, group: Any = None) -> Recovery:
        """Agree on the newest untorn step and bring every rank of the round to it (a
        collective over ``group``, default the default process group; see
        :mod:`trainguard.live`). Returns a :class:`Recovery`; when its ``fallback`` is set,
        load a checkpoint and call :meth:`restored`."""
        from trainguard.live import _recover

        t0 = time.monotonic()
        got = _recover.run(self, group)
        if got.fallback is not None:
            self._pending_newest = got.newest
            self._writing()  # the caller loads a checkpoint into it next: torn until restored()
        got = got.timed(time.monotonic() - t0)
        _recover.report(got)
        return got

    # for _recover: the record, the marks around what writes into the state, a transfer's end
    def _record(self) -> tuple[int | None, bool]:
        return self._step, self._torn

    def _writing(self) -> None:
        """Something is about to write into the state (a transfer received in place, a
        fallback's checkpoint load, :meth:`load_state_dict`): from now on the record says torn,
        so that this rank is never a donor of what it holds, until a complete, verified load
        (:meth:`_received`) or :meth:`restored`. A rank without a step has no record to
        protect (it is never a donor) and keeps none: a first start stays a first start."""
        if self._step is not None:
            self._torn = True

    def _received(self, state: Any, step: int) -> None:
        self.load_state_dict(state)
        self._step, self._torn = step, False
