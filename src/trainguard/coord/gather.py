"""All-gather of small values through a ``torch.distributed.Store`` (no process group).

Every participant calls :func:`gather` once with the same ``prefix`` (unique to this gather)::

    P/<r>      participant r's value (JSON)
    P/seen     add(): how many have read every value; the last one deletes P's keys

Each participant sets its value, waits for every participant's key with one ``Store.wait``
(woken by the store, no polling), reads them and counts itself in ``P/seen``. Meant for small
values (a few KiB each): the store holds all of them at once.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from trainguard.coord.barrier import wait_all
from trainguard.coord.keys import decode, encode
from trainguard.coord.store import as_store
from trainguard.errors import CoordinationError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["gather"]


def gather(
    store: Store,
    prefix: str,
    value: Any,
    *,
    rank: int,
    world_size: int,
    timeout: float,
    what: str = "values",
    hint: str = "",
) -> dict[int, Any]:
    """Every participant's ``value`` (JSON-encodable), by rank; the same on every participant.

    Raises :class:`CoordinationError` naming the participants that did not set their value
    within ``timeout`` seconds (dead, hung, or not calling); ``what`` and ``hint`` go into its
    message (what was gathered, and what the caller should check).
    """
    store.set(f"{prefix}/{rank}", encode(value).decode())
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    if not wait_all(as_store(store), keys, timeout, what=f"{what} of every rank"):
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        raise CoordinationError(
            f"ranks did not report {what} within {timeout:g} s" + (f"; {hint}" if hint else ""),
            causes={r: "did not report (dead, hung, or not calling)" for r in missing}
            or {rank: "the store wait timed out"},
        )
    out = {}
    for r in range(world_size):
        raw = store.get(keys[r])
        try:
            out[r] = decode(raw)
        except (ValueError, UnicodeDecodeError):
            raise CoordinationError(
                f"rank {r}'s value of {what} in the store is unreadable: {bytes(raw)[:200]!r}; "
                "something other than this job wrote it (give each job its own store and set "
                "TRAINGUARD_JOB_SECRET)",
                causes={r: "unreadable value in the store"},
            ) from None
    if int(store.add(f"{prefix}/seen", 1)) == world_size:
        for key in [*keys, f"{prefix}/seen"]:
            with contextlib.suppress(Exception):  # best effort: a missing key is fine
                store.delete_key(key)
    return out
