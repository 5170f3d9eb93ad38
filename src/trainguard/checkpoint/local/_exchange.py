"""Small all-gathers through the torch.distributed Store (no collective on any process group).

Every rank calls :func:`allgather` with the same ``prefix`` once; each sets its value under
``prefix/<rank>``, waits for everyone's, and the last rank to have read them deletes the keys.
The values are small JSON documents (lists of parts), a few KiB per rank.
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from typing import Any

from trainguard.errors import CoordinationError


def allgather(
    store: Any, prefix: str, rank: int, world_size: int, value: Any, *, timeout: float
) -> dict[int, Any]:
    """Every rank's ``value``, by rank. :class:`CoordinationError` names the ranks that never
    reported within ``timeout`` seconds (dead or hung)."""
    if store is None:
        return {rank: json.loads(json.dumps(value))}
    store.set(f"{prefix}/{rank}", json.dumps(value, separators=(",", ":")))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        raise CoordinationError(
            f"ranks did not report what they hold within {timeout} s; every rank must call "
            "the same LocalCheckpointManager method together",
            causes={r: "did not report (dead, hung, or not calling)" for r in missing}
            or {rank: f"store wait failed: {exc}"},
        ) from exc
    out = {r: json.loads(store.get(keys[r])) for r in range(world_size)}
    if store.add(f"{prefix}/seen", 1) == world_size:
        for key in [*keys, f"{prefix}/seen"]:
            with contextlib.suppress(Exception):
                store.delete_key(key)
    return out
