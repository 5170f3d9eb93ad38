"""Death notices: what a sidecar writes to the store when a rank is gone.

A rank is gone when its training process died (its own sidecar saw the pidfd wake) or when
its heartbeats stopped (another rank's sidecar declared it silent). Either way the others
must learn it at once, wherever the rank was in the protocol:

- inside round ``n``: the round's outcome becomes a fault (the others abort), and the rank's
  arrival at round ``n+1``'s barrier is recorded as a departure, so that barrier completes as
  soon as the live ranks arrive;
- already at round ``n+1``'s barrier (it wrote its record, and maybe its count, and maybe it
  was the last arrival and died before publishing the round): its arrival is turned into a
  departure (:meth:`Session.take_arrival`); if the round was published with the rank in it
  anyway, the notice follows it into that round and starts over.

The rank is then counted out of the job once, whoever writes the notice
(:meth:`Session.count_out`).
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Any

from trainguard import events
from trainguard.coord.barrier import wait_key
from trainguard.coord.keys import Keyspace, decode
from trainguard.restart._session import Session
from trainguard.restart.state import RoundOutcome


class _Policies:
    """The parts of the Wrapper's configuration a detached session reads."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        policies = cfg.get("policies")
        if policies:
            self.rank_assignment, self.rank_filter, self.retry = pickle.loads(
                base64.b64decode(policies)
            )
        else:  # the policies could not be pickled (lambdas): lay rounds out with ShiftRanks
            from trainguard.restart.policy.assignment import ShiftRanks

            self.rank_assignment, self.rank_filter, self.retry = ShiftRanks(), None, None
        self.barrier_timeout = float(cfg["barrier_timeout"])
        self.store_timeout = float(cfg["store_timeout"])


def write_notice(
    store: Any,
    cfg: dict[str, Any],
    r: int,
    n: int,
    roster: tuple[int, ...],
    cause: str,
) -> dict[str, Any]:
    """Rank ``r``, last seen in round ``n`` (-1: before the first barrier) whose ranks were
    ``roster``, is gone for ``cause``. Returns what was done (also emitted as ``rank_gone``)."""
    keys = Keyspace(cfg["job"], cfg["call"])
    policies = _Policies(cfg)
    world = int(cfg["world"])
    start = time.monotonic()
    while True:
        session = Session.detached(keys=keys, world=world, coord=store, cfg=policies, roster=roster)
        if not store.check([keys.member(n + 1, r)]) and n >= 0:
            # Gone inside round n: a fault of that round, so the others abort it.
            outcome = RoundOutcome.fault(r, cause, "RankGone")
            store.compare_set(keys.stop(n), "", outcome.encode())
        if not session.take_arrival(n + 1, r, cause):
            break  # its departure is recorded before any record of its own: it is out
        # It had arrived at round n+1's barrier. The barrier completes now without waiting
        # for it, unless the round was laid out from its own record before the departure.
        raw = wait_key(store, keys.ready(n + 1), policies.barrier_timeout, what="barrier")
        ready = decode(raw)
        n += 1
        roster = tuple(ready["active"]) + tuple(ready["spare"])
        if r not in roster or ready.get("end"):
            break
    counted = session.count_out(r)
    duration = time.monotonic() - start
    done: dict[str, Any] = {"gone_rank": r, "gone_round": n, "cause": cause, "counted": counted}
    events.emit("rank_gone", duration=duration, **done)
    return {**done, "duration": duration}
