"""Where a fault came from: the host it happened on and its cause (kind and place).

Every round that ends with a fault has one outcome (:class:`~trainguard.restart.state.RoundOutcome`:
the rank that faulted first, the fault's kind and description). Whoever lays the next round out
(:mod:`._book`) turns it into a :class:`Blame`: that rank's host (from its barrier record, or
from the hosts known before for a rank that is gone: a death, a lost node), the fault's kind
(the exception's type, ``Hang``, ``RankGone``, ``Straggler``, ``NonFiniteError``...) and, for an
exception, its place (``file:line`` of the frame that raised it, from
:func:`~trainguard.restart.state.describe`).

Every rank that raised in the round, first or not, puts the cause of its own exception in its
next barrier record (:func:`cause_of`), so that one round shows whether the same error at the
same place happened on several hosts: a software bug, which :mod:`._health` counts against no
host.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from trainguard.restart.state import RoundOutcome

__all__ = ["Blame", "blame_of", "cause_of", "is_collective", "place_of"]

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # .../trainguard/


def place_of(description: str) -> str:
    """``file:line`` of the raising frame in a :func:`describe` text, "" when it has none.

    ``describe`` writes ``Type: message (file:line in fn <- file:line in fn ...)``, the
    raising frame first. Frames inside trainguard are skipped when the text has another (an
    error raised by ``call.check_finite`` or a checkpoint call is placed at its caller)."""
    if not description.endswith(")"):
        return ""
    _, sep, where = description.rpartition(" (")
    if not sep:
        return ""
    places = []
    for frame in where[:-1].split(" <- "):
        file_line, sep, _ = frame.rpartition(" in ")
        if sep and ":" in file_line:
            places.append(file_line)
    outside = [p for p in places if not p.startswith(_PACKAGE)]
    return (outside or places or [""])[0]


def cause_of(kind: str, description: str) -> str:
    """A fault's cause as one string: ``kind`` and, when known, ``@ file:line``."""
    place = place_of(description)
    return f"{kind} @ {place}" if place else kind


def is_collective(cause: str) -> bool:
    """Whether ``cause`` (:func:`cause_of`) is a collective that failed under this rank: a
    ``Dist*`` error of torch.distributed or an exception raised inside it. Such an error is
    most often the consequence of another rank's fault (its connections closed, its group
    destroyed), not a cause of its own."""
    kind, _, place = cause.partition(" @ ")
    return kind.startswith("Dist") or "torch/distributed/" in place.replace(os.sep, "/")


@dataclasses.dataclass(frozen=True)
class Blame:
    """One round's fault, attributed.

    Attributes:
        rank: the initial rank that faulted first.
        host: its host ("" when not known).
        kind: the fault's kind (exception type name, ``Hang``, ``RankGone``...).
        cause: kind and place (:func:`cause_of`), the key under which repeats are compared.
        time: when it happened (wall clock).
        counted: whether it counts against ``host`` (False: a software bug, or no host known).
    """

    rank: int
    host: str
    kind: str
    cause: str
    time: float
    counted: bool = True

    def encode(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def decode(cls, value: object) -> Blame | None:
        if not isinstance(value, dict):
            return None
        try:
            blame = cls(**value)
        except TypeError:
            return None
        ok = (
            type(blame.rank) is int
            and all(isinstance(v, str) for v in (blame.host, blame.kind, blame.cause))
            and type(blame.time) in (int, float)
            and isinstance(blame.counted, bool)
        )
        return blame if ok else None


def blame_of(outcome: RoundOutcome | None, host: str) -> Blame | None:
    """The round's fault (its ``outcome``, read from the store) on ``host``; None when the round
    did not end with a fault of a rank (it completed, ended the job, admitted a newcomer)."""
    if outcome is None or outcome.why != "fault" or outcome.rank is None:
        return None
    kind = outcome.type or "Fault"
    cause = cause_of(kind, outcome.error or "")
    when = outcome.time if outcome.time is not None else 0.0
    return Blame(outcome.rank, host, kind, cause, when, counted=bool(host))
