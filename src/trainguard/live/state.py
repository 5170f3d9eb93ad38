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
            Their state may hold DTensors (FSDP2, HSDP, tensor parallelism): then the ranks
            that hold the same local shards are found from the placements and the mesh (and
            ``replica_group`` only splits them further). Objects rebuilt every round on the
            round's mesh are given to :meth:`recover` instead; register their names with None
            here (``LiveState(model=None, optimizer=None)``).
        snapshot_every: peer snapshots (:mod:`._snapshot`), for state that no replica holds
            (FSDP2 on a 1-D mesh, tensor parallelism without data parallelism): every this
            many completed updates each rank copies its local state into host memory, in a
            background thread overlapped with the next step, and the same bytes go to a
            buddy rank on another host. After a fault that no replica can repair, the lost
            shards come from the buddy's copy and every rank goes back to the snapshot's
            step: at most ``snapshot_every`` steps run again. None or 0 (the default): off.
            The same on every rank. Nothing may write into the registered state outside
            :meth:`update` (the copy reads it until the next update begins).
        snapshot_memory_limit: the host bytes the snapshots may take on each rank (two copies
            of its own local state, the newest and the one before, and one of its buddy's);
            None: no limit. Checked when the first
            snapshot is sized: over it, :meth:`update` raises a ``ConfigError``.

    Raises :class:`~trainguard.errors.ConfigError` when nothing is registered, an object lacks
    ``state_dict``/``load_state_dict``, or ``replica_group`` is of another type.
    """

    def __init__(
        self,
        *,
        rng: bool = True,
        replica_group: ReplicaGroup = None,
        snapshot_every: int | None = None,
        snapshot_memory_limit: int | None = None,
        **objects: Any,
    ):
        from trainguard.live import _snapshot

        every = _snapshot.check_options(snapshot_every, snapshot_memory_limit)
        if not objects:
            raise ConfigError(
                "LiveState() needs the objects to keep: LiveState(model=net, optimizer=opt)"
            )
        _check_objects("LiveState", objects, placeholders=True)
        if not (
            replica_group is None
            or callable(replica_group)
            or (isinstance(replica_group, int | str) and not isinstance(replica_group, bool))
        ):
            raise ConfigError(
                f"LiveState(replica_group={replica_group!r}): give None (every rank holds the "
                f"same state), an int or str key, or a function (rank, world_size) -> key"
            )
        self._objects: dict[str, Any] = dict(objects)  # what the record describes
        self._incoming: dict[str, Any] | None = None  # this recover()'s rebuilt objects
        self._rng = rng
        self._replica_group = replica_group
        self._step: int | None = None
        self._torn = False
        self._pending_newest: int | None = None  # a fallback's newest step, until restored()
        #: test hook (see :mod:`trainguard.live._transfer`): corrupts what this rank sends
        self._tamper: Any = None
        self._snaps = _snapshot.Snapshots(every, snapshot_memory_limit) if every else None

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
        if self._snaps is not None:
            self._snaps.wait()  # the last snapshot read the state until now
        with call.atomic() if call is not None else contextlib.nullcontext():
            self._torn = True
            yield
            self._step = step + 1
            self._torn = False
        if self._snaps is not None and self._snaps.due(step + 1):
            self._snaps.take(self._outgoing(), step + 1)

    def flush(self) -> None:
        """Wait until the peer snapshot in flight is complete (its copy and its transfer to
        the buddy). Call it at the end of a round that takes snapshots, before
        ``destroy_process_group()`` (a transfer needs the round's groups); without
        snapshots it does nothing."""
        if self._snaps is not None:
            self._snaps.wait()

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
        return self._state_of(self._objects)

    def _state_of(self, objects: dict[str, Any]) -> dict[str, Any]:
        import torch

        missing = sorted(n for n, o in objects.items() if o is None)
        if missing:
            raise ConfigError(
                f"live state {missing} registered without objects: give them to "
                f"live.recover({missing[0]}=...) in every round"
            )
        out: dict[str, Any] = {"objects": {n: o.state_dict() for n, o in objects.items()}}
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

        self._writing()
        self._load_into(self._objects, state)

    def _load_into(self, into: dict[str, Any], state: dict[str, Any]) -> None:
        import torch

        objects = state["objects"]
        missing = sorted(set(into) - set(objects))
        if missing:
            raise ConfigError(
                f"live state lacks {missing}: every rank must register the same names"
            )
        for name, obj in into.items():
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

    def recover(self, *, group: Any = None, **objects: Any) -> Recovery:
        """Agree on the newest untorn step and bring every rank of the round to it (a
        collective over ``group``, default the default process group; see
        :mod:`trainguard.live`). Returns a :class:`Recovery`; when its ``fallback`` is set,
        load a checkpoint and call :meth:`restored`.

        ``**objects``: this round's objects, rebuilt on its process group and mesh (an FSDP2
        model sharded again with ``fully_shard``, its new optimizer), by the registered
        names, all of them. The state moves into them: a rank at the agreed step loads its
        own state of the last round into them (locally, no transfer), a receiver takes a
        donor's into them; on a fallback the checkpoint is loaded into them. From then on
        they are the registered objects. A rank whose own state was sharded otherwise than
        the new objects (another mesh, another rank's coordinates) holds nothing this round
        and receives."""
        from trainguard.live import _recover

        if objects:
            _check_objects("live.recover", objects, placeholders=False)
            if set(objects) != set(self._objects):
                raise ConfigError(
                    f"live.recover({', '.join(sorted(objects))}=...): give every registered "
                    f"object ({', '.join(sorted(self._objects))}), rebuilt for this round"
                )
        elif any(o is None for o in self._objects.values()):
            missing = sorted(n for n, o in self._objects.items() if o is None)
            raise ConfigError(
                f"live.recover() needs this round's {missing} (registered without objects): "
                f"live.recover({missing[0]}=...)"
            )
        self._incoming = dict(objects) if objects else None
        t0 = time.monotonic()
        try:
            got = _recover.run(self, group)
        finally:
            self._incoming = None
        if got.fallback is not None:
            self._pending_newest = got.newest
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

    def _target(self) -> dict[str, Any]:
        """The objects this round's state goes into (rebuilt ones, else the registered)."""
        return self._incoming if self._incoming is not None else self._objects

    def _layout(self) -> str:
        """The DTensor layout this rank holds in the round (see :mod:`._sharded`)."""
        from trainguard.live import _sharded

        return _sharded.signature(self._target())

    def _fits(self) -> bool:
        """Whether the state held fits this round's objects (the same local shards)."""
        from trainguard.live import _sharded

        if self._incoming is None:
            return True
        try:
            fits = _sharded.signature(self._objects) == self._layout()
        except Exception:  # the old objects cannot say: they hold nothing usable here
            logger.warning("live state: the last round's objects gave no state", exc_info=True)
            return False
        if not fits:
            logger.warning(
                "live state: this rank's shards of the last round are not the ones it holds "
                "in this round's objects (another mesh or coordinates): it receives or falls back"
            )
        return fits

    def _begin(self, keep: bool) -> None:
        """After the plan: a rank at the agreed step (``keep``) moves its state into this
        round's rebuilt objects (nothing to do without them); any other rank is torn from
        now on (it receives, or a checkpoint is loaded into it) and the record describes
        the new objects."""
        from trainguard.live import _sharded

        if not keep:
            self._writing()
        elif self._incoming is not None and self._incoming is not self._objects:
            local, paths = _sharded.local_form(self._state_of(self._objects))
            state, problem = _sharded.install(local, paths, _sharded.Targets(self._incoming))
            if problem is not None:
                raise ConfigError(f"live state does not fit this round's objects: {problem}")
            self._load_into(self._incoming, state)
        self._objects = self._target()
        self._incoming = None

    def _snapshots(self) -> Any:
        """This state's :class:`._snapshot.Snapshots`, None without snapshots."""
        return self._snaps

    def _restore_own(self, step: int) -> str | None:
        """Load this rank's own snapshot of ``step`` (its tensors are handed to the state and
        not reused by the next snapshot); why not, if it does not fit."""
        snap = None if self._snaps is None else self._snaps.find(step, "own")
        if self._snaps is None or snap is None:
            return f"no own snapshot of step {step}"
        problem = self._received(snap.state, step)
        self._snaps.forget(snap)
        return problem

    def _outgoing(self) -> dict[str, Any]:
        """What a donor sends (and a receiver receives into): the state's local form."""
        from trainguard.live import _sharded

        local, paths = _sharded.local_form(self.state_dict())
        return {"state": local, "dtensors": paths}

    def _received(self, got: Any, step: int) -> str | None:
        """Load a verified transfer (:meth:`_outgoing` of a donor); why not, if it does not
        fit this rank's objects."""
        from trainguard.live import _sharded

        if not isinstance(got, dict) or "state" not in got:
            return "a transfer without a state"
        targets = _sharded.Targets(self._objects)
        state, problem = _sharded.install(got["state"], got.get("dtensors"), targets)
        if problem is not None:
            return problem
        self.load_state_dict(state)
        self._step, self._torn = step, False
        return None


def _check_objects(where: str, objects: dict[str, Any], *, placeholders: bool) -> None:
    for name, obj in objects.items():
        if obj is None and placeholders:
            continue
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise ConfigError(
                f"{where}({name}=...): a {type(obj).__name__} has no state_dict() and "
                f"load_state_dict(); register objects that have both (a module, an "
                f"optimizer, a scheduler, a stateful loader)"
            )
