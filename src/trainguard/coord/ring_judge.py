"""Judging a node ring: the value a node beats, and what one read of the ring says.

A pure function of gathered data (:func:`judge`: the readings in ring order, the members'
clocks, the time, the members seen gone), with no store and no clock of its own, so that it is
tested on data alone. :class:`trainguard.coord.node_ring.NodeRing` reads the keys, calls it and
acts on its verdicts; the protocol is in that module's docstring.

Values of a node's key: ``<members>/<instance>/<counter>`` (a beat, :func:`node_value`), ``bye``
(:data:`trainguard.coord.liveness.BYE`: the node ended or its leader left), ``lost/...``
(:data:`LOST`: another node counted it out), anything else (:data:`NO_BEAT`, the blank of a key
that no node beats, or garbage) is no beat and is not judged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from trainguard.coord.liveness import BYE, MAX_DIGITS, Clock, clock_after

__all__ = [
    "LOST",
    "MAX_MEMBERS",
    "NO_BEAT",
    "Judgement",
    "Verdict",
    "judge",
    "node_value",
    "parse_value",
    "unbeaten",
]

#: prefix of the mark a node writes over a counted-out member's last value
LOST = b"lost/"
#: the value a key is made to exist with when its member is not judged until it beats
NO_BEAT = b"0"
#: the most members one value may list (a value listing more is no beat)
MAX_MEMBERS = 4096


def node_value(members: Iterable[int], instance: bytes, counter: int) -> bytes:
    """A beat: ``<members>/<instance>/<counter>``."""
    return b",".join(str(m).encode() for m in members) + b"/" + instance + b"/%d" % counter


def unbeaten(member: int) -> bytes:
    """The blank of a member that is judged before its first beat: a beat of counter 0."""
    return node_value((member,), b"-", 0)


def parse_value(raw: bytes) -> tuple[list[int], int] | None:
    """A beat as (its members, its counter); None for ``bye``, a lost mark, a blank or any
    value that is not ``<members>/<instance>/<counter>``."""
    parts = raw.split(b"/")
    if len(parts) != 3 or raw.startswith(LOST):
        return None
    head, _, counter = parts
    if not counter.isdigit() or len(counter) > MAX_DIGITS:
        return None
    members = head.split(b",") if head else []
    if len(members) > MAX_MEMBERS or not all(p.isdigit() and len(p) <= 9 for p in members):
        return None
    return [int(p) for p in members], int(counter)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one reading of a member's key says (:func:`judge`).

    ``state``: ``"ended"`` (``bye``), ``"lost"`` (a lost mark), ``"gone"`` (seen gone before,
    unchanged since), ``"quiet"`` (no beat: not judged) or ``"beat"``; for a beat, the members
    it lists, how long it has not moved, whether that is ``timeout`` or more (``late``) and
    whether it beats again after its member was seen gone (``back``)."""

    member: int
    raw: bytes
    state: str
    members: tuple[int, ...] = ()
    silent: float = 0.0
    late: bool = False
    back: bool = False


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The verdicts of one read, in ring order, and the clocks after it."""

    verdicts: list[Verdict]
    clocks: dict[int, Clock]

    @property
    def silent(self) -> list[int]:
        """The members whose beat did not move for ``timeout``."""
        return [v.member for v in self.verdicts if v.late]


def judge(
    readings: Iterable[tuple[int, bytes]],
    clocks: Mapping[int, Clock],
    now: float,
    *,
    timeout: float,
    gone: Mapping[int, bytes | None] | None = None,
) -> Judgement:
    """Judge one read of a ring: ``readings`` (member, value) in ring order, read at ``now``;
    ``clocks`` the members' clocks before (member -> (value, since)); ``gone`` the members seen
    gone before, with the value they went with (None: none known). No store, no clock of its
    own: the same data always give the same judgement. A clock runs on the raw value (any
    change of it is a beat); an ended, lost or quiet member has none."""
    gone = {} if gone is None else gone
    after, verdicts = dict(clocks), []
    for m, raw in readings:
        if m in gone and raw == gone[m]:
            after.pop(m, None)
            verdicts.append(Verdict(m, raw, "gone"))
            continue
        parsed = None if raw == BYE or raw.startswith(LOST) else parse_value(raw)
        if parsed is None:
            after.pop(m, None)
            state = "ended" if raw == BYE else "lost" if raw.startswith(LOST) else "quiet"
            verdicts.append(Verdict(m, raw, state))
            continue
        back = m in gone
        after[m], silent = clock_after(None if back else after.get(m), raw, now)
        late = silent >= timeout
        verdicts.append(Verdict(m, raw, "beat", tuple(parsed[0]), silent, late, back))
    return Judgement(verdicts, after)
