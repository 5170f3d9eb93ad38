"""Death notices: what a sidecar writes to the store when a rank is gone.

A rank is gone when its training process died (its own sidecar saw the pidfd wake) or when
its heartbeats stopped (another rank's sidecar declared it silent). Either way the others
must learn it at once, wherever the rank was in the protocol:

- inside round ``n``: the round's outcome becomes a fault (the others abort), and the rank's
  arrival at round ``n+1``'s barrier is recorded as a departure, so that barrier completes as
  soon as the live ranks arrive;
- already at round ``n+1``'s barrier (it wrote its record, and maybe its count, and maybe it
  was the last arrival and died before publishing the round): its arrival is turned into a
  departure (:meth:`RoundBook.take_arrival`); if the round was published with the rank in it
  anyway, the notice follows it into that round and starts over.

The rank is then counted out of the job once, whoever writes the notice
(:meth:`RoundBook.count_out`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from trainguard import events
from trainguard.coord.barrier import wait_key
from trainguard.restart import _records
from trainguard.restart._book import RoundBook
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.state import RoundOutcome


@dataclasses.dataclass(frozen=True)
class Notice:
    """What a death notice did (also emitted as the ``rank_gone`` event)."""

    gone_rank: int
    gone_round: int  # the last round the rank was in
    cause: str
    counted: bool  # this notice counted the rank out of the job (not an earlier one)
    duration: float  # seconds the notice took


def write_notice(
    store: Any, cfg: SidecarConfig, r: int, n: int, roster: tuple[int, ...], cause: str
) -> Notice:
    """Rank ``r``, last seen in round ``n`` (-1: before the first barrier) whose ranks were
    ``roster``, is gone for ``cause``; ``store`` is this notice's own connection."""
    keys = cfg.keys
    policies = cfg.round_policies()
    start = time.monotonic()
    while True:
        book = RoundBook(
            store, keys, cfg.world, policies, store_timeout=cfg.store_timeout, roster=roster
        )
        if not store.check([keys.member(n + 1, r)]) and n >= 0:
            # Gone inside round n: a fault of that round, so the others abort it.
            outcome = RoundOutcome.fault(r, cause, "RankGone")
            store.compare_set(keys.stop(n), "", outcome.encode())
        if not book.take_arrival(n + 1, r, cause):
            break  # its departure is recorded before any record of its own: it is out
        # It had arrived at round n+1's barrier. The barrier completes now without waiting
        # for it, unless the round was laid out from its own record before the departure.
        raw = wait_key(store, keys.ready(n + 1), cfg.barrier_timeout, what="barrier")
        ready = _records.layout(raw)
        n += 1
        roster = tuple(ready["active"]) + tuple(ready["spare"])
        if r not in roster or ready.get("end"):
            break
    counted = book.count_out(r)
    notice = Notice(r, n, cause, counted, time.monotonic() - start)
    events.emit(
        "rank_gone",
        duration=notice.duration,
        gone_rank=r,
        gone_round=n,
        cause=cause,
        counted=counted,
    )
    return notice
