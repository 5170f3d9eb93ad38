"""How a checkpointer joins the job's store: which store and ranks, and its own key prefix.

Shared by :class:`~trainguard.checkpoint.AsyncCheckpointer` and
:class:`~trainguard.checkpoint.LocalCheckpointManager`. Every rank creates its checkpointers in
the same order; each checkpointer counts itself in ``<key_prefix>/instances`` and takes the
*generation* ``(count - 1) // world_size``, so that keys of an earlier checkpointer (say, of the
previous restart round) can never count for a later one. The job secret
(:func:`trainguard.coord._secret.current`: ``TRAINGUARD_JOB_SECRET``, or that of the wrapped
call the checkpointer is made in) follows the key prefix, so that nobody who can reach the
store but does not know it can forge a commit.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import TYPE_CHECKING, Any

from trainguard import _torchcompat, events
from trainguard.coord import _secret
from trainguard.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store


def resolve(
    store: Store | None, rank: int | None, world_size: int | None
) -> tuple[Store | None, int, int]:
    """``(store, rank, world_size)`` from the arguments, else from torch.distributed.

    Without a store and with torch.distributed initialized, the default process group's store
    is used. A store needs a rank and world size (given, or from torch.distributed); without a
    store there is one rank. Raises :class:`ConfigError` for what does not fit together.
    """
    import torch.distributed as dist

    _check_store(store)
    initialized = dist.is_available() and dist.is_initialized()
    if store is None and initialized:
        store = dist.distributed_c10d._get_default_store()
    if store is None:
        if rank not in (None, 0) or world_size not in (None, 1):
            raise ConfigError("rank/world_size need a store or an initialized torch.distributed")
        return None, 0, 1
    if rank is None or world_size is None:
        if not initialized:
            raise ConfigError(
                "with a store, pass rank= and world_size= (or initialize torch.distributed)"
            )
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is not in range(world_size={world_size})")
    return store, rank, world_size


def default_group() -> Any:
    """torch.distributed's default process group, or None when it is not initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


class RoundWatch:
    """Which default process group a checkpointer is bound to, without keeping it alive.

    A restart round (in-process restart, or any re-initialization of torch.distributed) builds a
    new default group: :meth:`changed` then says the checkpointer must re-bind its round-
    dependent parts (store, rank, world size, replication group) before its next operation. A
    checkpointer given an explicit store is bound to that store, not to a group, and never
    re-binds by itself.
    """

    def __init__(self, group: Any, *, explicit: bool) -> None:
        self.explicit = explicit
        self._bound = group is not None
        self._ref = weakref.ref(group) if group is not None else None

    @property
    def unbound(self) -> bool:
        """Bound to neither a group nor a store (built before torch.distributed)."""
        return not self._bound and not self.explicit

    def changed(self) -> bool:
        """True when the default group is not the one bound (a new round began).

        Raises :class:`CheckpointError` when the bound group was destroyed and none replaced
        it yet (the new round's ``init_process_group`` has not run).
        """
        if self.explicit:
            return False
        current = default_group()
        if not self._bound:
            return current is not None
        if self._ref is not None and self._ref() is current:
            return False
        if current is None:
            raise CheckpointError(
                "the process group this checkpointer was bound to is gone and torch.distributed "
                "is not initialized again yet: call init_process_group() for the new round "
                "before using the checkpointer (it then re-binds by itself), or bind(store=...)"
            )
        return True


def setup_done(checkpointer: str, started: float, rank: int, world_size: int) -> None:
    """The ``ckpt_setup`` event of a checkpointer built or re-bound (``checkpointer`` is
    ``"async"`` or ``"local"``; a field named ``kind`` is impossible: it is the event's own)."""
    events.emit(
        "ckpt_setup",
        duration=time.monotonic() - started,
        checkpointer=checkpointer,
        rank_in_round=rank,
        world_size=world_size,
    )


def _check_store(store: object) -> None:
    if store is None or hasattr(store, "add"):
        return
    if isinstance(store, str):
        from trainguard.coord.store import parse_addr

        try:
            parse_addr(store)
        except ConfigError as exc:
            raise ConfigError(f"store={store!r}: {exc}") from None
        raise ConfigError(
            f"store={store!r}: pass a torch.distributed Store, e.g. "
            "torch.distributed.TCPStore(host, port, is_master=False), not an address"
        )
    raise ConfigError(f"store={store!r} is not a torch.distributed Store")


@dataclasses.dataclass(frozen=True)
class StoreLink:
    """A checkpointer's place in the store: ``prefix`` is ``<key_prefix>/<generation>``.

    ``origin`` is the store given; holding it keeps rank 0's store server alive for as long as
    the checkpointer needs it. Every rank calls :meth:`join` once per checkpointer, in the same
    order.
    """

    origin: Store
    prefix: str

    @classmethod
    def join(cls, store: Store, *, key_prefix: str, world_size: int) -> StoreLink:
        secret = _secret.current()
        if secret:
            key_prefix = f"{key_prefix}/{secret}"
        generation = (int(store.add(f"{key_prefix}/instances", 1)) - 1) // world_size
        return cls(store, f"{key_prefix}/{generation}")

    def client(self) -> Store:
        """A client of its own (``Store.clone()`` where there is one): a pending ``wait()``
        holds a TCPStore client for its whole duration, so each thread that waits needs one."""
        own: Store | None = _torchcompat.clone_store(self.origin)
        return self.origin if own is None else own
