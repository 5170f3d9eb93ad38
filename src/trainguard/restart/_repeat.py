"""A fault that can only repeat: the same error at the same place, round after round, with
no progress between the rounds, ends the job instead of restarting it forever.

Whoever lays a round out (:mod:`._book`) reads the barrier records of the ranks: the fault
that ended the previous round (its description names the exception, its message and the
place it was raised, see :func:`~trainguard.restart.state.describe`) and whether each rank
made progress in it (:mod:`trainguard._progress`: a ``call.ping()`` or a checkpoint save).
:class:`Repeats` counts the run of such rounds and travels with the published round, so the
next round's publisher, whichever rank it is, continues the count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Repeats"]


@dataclasses.dataclass(frozen=True)
class Repeats:
    """The run of consecutive rounds that ended with the same fault and made no progress.

    Attributes:
        cause: the fault's description (exception type, message, where it was raised).
        rank: the initial rank whose fault it was, last time.
        count: how many rounds in a row ended with it (0: no run).
    """

    cause: str = ""
    rank: int = -1
    count: int = 0

    def after(self, faults: Mapping[int, str], progress: bool) -> Repeats:
        """The run once a round ended with ``faults`` (initial rank -> description of the
        fault it raised first; empty for a hang or a lost rank) and ``progress``."""
        if progress or len(faults) != 1:
            return Repeats()
        ((rank, cause),) = faults.items()
        count = self.count + 1 if cause == self.cause else 1
        return Repeats(cause, rank, count)

    def verdict(self, limit: int | None) -> str | None:
        """Why the job ends (the run reached ``limit``), or None."""
        if limit is None or self.count < limit:
            return None
        return (
            f"{self.count} rounds in a row failed with the same error at the same place, with "
            f"no progress between them (no call.ping() and no checkpoint saved), last on rank "
            f"{self.rank}: {self.cause}. Restarting cannot make it go away: fix it, or pass "
            "Wrapper(max_repeated_faults=N) with a larger N (None: never stop for this)"
        )

    def encode(self) -> dict[str, Any]:
        """The JSON form published with the round."""
        return {"cause": self.cause, "rank": self.rank, "count": self.count}

    @classmethod
    def decode(cls, value: object) -> Repeats:
        """Back from :meth:`encode`; anything malformed is no run."""
        if not isinstance(value, dict):
            return cls()
        cause, rank, count = value.get("cause"), value.get("rank"), value.get("count")
        if not (isinstance(cause, str) and type(rank) is int and type(count) is int):
            return cls()
        return cls(cause, rank, max(count, 0))
