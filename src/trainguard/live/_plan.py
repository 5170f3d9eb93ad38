"""The round's agreement on live state: from every rank's record to who keeps, gives, receives.

A pure function of the records that every rank gathered (the same list on every rank), so
every rank computes the same plan without another message.
"""

from __future__ import annotations

import dataclasses

#: what names a replica group: ranks with equal keys hold replicas of the same state
GroupKey = int | str

__all__ = [
    "FIRST_START",
    "NO_STEP",
    "Plan",
    "Record",
    "SnapPlan",
    "no_holder",
    "plan",
    "snapshot_plan",
]

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
    #: peer snapshots (:mod:`._snapshot`): the step and group key of this rank's own
    #: snapshot, of the one before it and of the one it holds for its buddy (``NO_STEP``:
    #: none); its host's id; its ``snapshot_every`` (0: off)
    own_step: int = NO_STEP
    own_key: int = 0
    prev_step: int = NO_STEP
    prev_key: int = 0
    held_step: int = NO_STEP
    held_key: int = 0
    host: int = 0
    every: int = 0

    @property
    def holder(self) -> bool:
        """Whether this rank's state can be given to others."""
        return self.step != NO_STEP and not self.torn

    @property
    def owns(self) -> set[tuple[int, int]]:
        """(step, key) of this rank's own snapshots."""
        return {(self.own_step, self.own_key), (self.prev_step, self.prev_key)}


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


@dataclasses.dataclass(frozen=True)
class SnapPlan:
    """A recovery from peer snapshots: every rank goes to ``step``. ``actions``: rank ->
    ``("keep", -1, "")`` (its live state is at the step), ``("own", -1, "")`` (it loads its
    own snapshot) or ``("recv", donor, what)``: it receives from ``donor`` that donor's
    ``what`` (``live`` state, ``own`` snapshot or the ``held`` copy of a buddy's)."""

    step: int
    newest: int
    actions: dict[int, tuple[str, int, str]]

    @property
    def receivers(self) -> list[int]:
        return sorted(r for r, (kind, *_) in self.actions.items() if kind == "recv")


def _sources(records: list[Record], key: int, step: int) -> list[tuple[int, str]]:
    """Who holds the state of replica group ``key`` at ``step``, and as what (live state
    first, then own snapshots, then buddies' copies)."""
    live = [(r.rank, "live") for r in records if r.holder and r.group == key and r.step == step]
    own = [(r.rank, "own") for r in records if (step, key) in r.owns]
    held = [(r.rank, "held") for r in records if r.held_step == step and r.held_key == key]
    return live + own + held


def _actions(records: list[Record], step: int) -> dict[int, tuple[str, int, str]] | None:
    """How every rank gets to ``step``, or None when some rank's shards are held nowhere."""
    actions: dict[int, tuple[str, int, str]] = {}
    for r in records:
        if r.holder and r.step == step:
            actions[r.rank] = ("keep", -1, "")
        elif (step, r.group) in r.owns:
            actions[r.rank] = ("own", -1, "")
        else:
            others = [s for s in _sources(records, r.group, step) if s[0] != r.rank]
            if not others:
                return None
            actions[r.rank] = ("recv", *others[0])
    return actions


def snapshot_plan(records: list[Record]) -> SnapPlan | str:
    """The newest step at which every replica group's state is held somewhere (live, in an
    own snapshot or in a buddy's copy), and how every rank gets to it; or why there is none."""
    newest = max((r.step for r in records if r.step != NO_STEP), default=0)
    steps = {s for r in records for s in (r.own_step, r.prev_step, r.held_step)}
    steps |= {r.step for r in records if r.holder}
    for step in sorted(steps - {NO_STEP}, reverse=True):
        actions = _actions(records, step)
        if actions is not None:
            return SnapPlan(step, newest, actions)
    held = sorted({s for r in records for s in (r.own_step, r.prev_step, r.held_step)})
    if held == [NO_STEP]:
        return "no rank holds a peer snapshot"
    return (
        "the peer snapshots do not line up: no step at which every replica group's shards "
        f"are held (snapshot steps held: {[s for s in held if s != NO_STEP]})"
    )
