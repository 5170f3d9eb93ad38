"""The round's agreement on live state: from every rank's record to who keeps, gives, receives.

A pure function of the records that every rank gathered (the same list on every rank), so
every rank computes the same plan without another message.
"""

from __future__ import annotations

import dataclasses

#: what names a replica group: ranks with equal keys hold replicas of the same state
GroupKey = int | str

__all__ = ["FIRST_START", "NO_STEP", "Plan", "Record", "no_holder", "plan"]

NO_STEP = -1  #: a record's step when the rank holds no live state (a spare, a new process)
FIRST_START = "no rank holds live state yet (a first start)"  #: the fallback of a first start


def no_holder(round: int) -> str:
    """The fallback of a later round (``round`` > 0) in which no rank holds live state: not a
    first start, the state the job had is lost with the ranks that held it."""
    return (
        f"no rank of round {round} holds live state: the ranks that held it are gone "
        "(or none had built it yet)"
    )


@dataclasses.dataclass(frozen=True)
class Record:
    """What one rank reports: the step its state is at (the next step to run, ``NO_STEP`` when
    it holds none), whether an update was torn, and its replica group's key."""

    rank: int
    step: int
    torn: bool
    group: int

    @property
    def holder(self) -> bool:
        """Whether this rank's state can be given to others."""
        return self.step != NO_STEP and not self.torn


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the round does. ``fallback`` is a reason (the caller loads a checkpoint) or None.

    ``step``: the agreed step (every rank's state is at it after the transfers); ``newest``:
    the newest step any rank's state was at, torn or not (a torn rank reports the step before
    its update): what a fallback recomputes is counted from it;
    ``donors``: group key -> the ranks that give that group's state, in order;
    ``receivers``: the ranks whose state is replaced, in rank order.
    """

    step: int
    newest: int
    fallback: str | None
    donors: dict[int, list[int]]
    receivers: list[int]
    groups: dict[int, int]  # rank -> group key

    def donor(self, receiver: int, attempt: int) -> int | None:
        """The donor of ``receiver`` at ``attempt`` (0 first), or None when the group has no
        donor left. Receivers of one group are spread over its donors (parallel transfers);
        each next attempt moves to the next donor."""
        donors = self.donors[self.groups[receiver]]
        if attempt >= len(donors):
            return None
        mine = [r for r in self.receivers if self.groups[r] == self.groups[receiver]]
        return donors[(mine.index(receiver) + attempt) % len(donors)]


def plan(records: list[Record], *, round: int | None = None) -> Plan:
    """Agree on the newest step that an untorn replica holds for every replica group.

    ``round``: the restart round this recovery runs in (None: not known). When no rank holds
    live state, the fallback is :data:`FIRST_START` only in round 0 (or an unknown round);
    in a later round it says that the state is gone with its holders (:func:`no_holder`)."""
    groups = {r.rank: r.group for r in records}
    newest = max((r.step for r in records if r.step != NO_STEP), default=0)
    members: dict[int, list[Record]] = {}
    for r in records:
        members.setdefault(r.group, []).append(r)
    if all(r.step == NO_STEP and not r.torn for r in records):
        why = FIRST_START if not round else no_holder(round)
        return Plan(0, newest, why, {}, [], groups)
    best: dict[int, int] = {}
    for key, recs in sorted(members.items()):
        steps = [r.step for r in recs if r.holder]
        if not steps:
            torn = sum(r.torn for r in recs)
            why = (
                f"no untorn replica of replica group {key} survived "
                f"({len(recs)} member(s), {torn} torn, {len(recs) - torn - len(steps)} without state)"
            )
            return Plan(0, newest, why, {}, [], groups)
        best[key] = max(steps)
    if len(set(best.values())) > 1:
        seen = ", ".join(f"group {k}: step {s}" for k, s in sorted(best.items()))
        why = f"the replica groups' newest untorn steps differ ({seen})"
        return Plan(0, newest, why, {}, [], groups)
    step = next(iter(best.values()))
    donors = {
        key: sorted(r.rank for r in recs if r.holder and r.step == step)
        for key, recs in members.items()
    }
    receivers = sorted(r.rank for r in records if not (r.holder and r.step == step))
    return Plan(step, newest, None, donors, receivers, groups)
