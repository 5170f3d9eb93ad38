"""A rank's record at a round's barrier: its line of the round's pool (its departure first),
for the tests of death notices."""

from __future__ import annotations

import time
from typing import Any

from trainguard.coord import Keyspace
from trainguard.restart import _pool
from trainguard.restart._book import peek
from trainguard.restart._records import BarrierRecord


def record_at(store: Any, keys: Keyspace, n: int, r: int) -> BarrierRecord | None:
    """Rank ``r``'s record at round ``n``'s barrier (its departure first in a pool), None when
    it has none (yet)."""
    pool = peek(store, keys.pool(n))
    return _pool.records_of(pool).get(r) if pool is not None else None


def left_at(store: Any, keys: Keyspace, n: int, r: int, timeout: float = 20.0) -> str:
    """Why rank ``r``'s record at round ``n``'s barrier says it left; waits up to ``timeout``
    seconds for a departure, and fails the test without one."""
    deadline = time.monotonic() + timeout
    while True:
        rec = record_at(store, keys, n, r)
        if rec is not None and rec.leave:
            return str(rec.leave)
        assert time.monotonic() < deadline, f"no notice of rank {r} at round {n}: {rec}"
        time.sleep(0.05)
