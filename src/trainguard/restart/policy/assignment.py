"""Rank assignment policies: map the ranks present in a round to rank numbers.

Each is a callable ``Layout -> Layout`` that sets ``order`` (index = rank). They run only on
the barrier's last arriver, so they need not be deterministic across ranks, but they must be
cheap. Compose them with :class:`~trainguard.restart.policy.Compose`, e.g.
``Compose(GroupedByKey("host", 8), ShiftRanks())``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from trainguard.errors import ConfigError
from trainguard.restart.policy.layout import Layout

__all__ = ["FillGaps", "GroupedByKey", "ShiftRanks"]


class ShiftRanks:
    """Close the gaps: present ranks keep their relative order and are numbered 0, 1, 2, ...

    Spares (after the active ranks in the previous order) move up behind them, so a spare
    becomes active as soon as the active ranks before it are fewer than the filter allows.
    """

    def __call__(self, layout: Layout) -> Layout:
        excluded = set(layout.excluded)
        order = tuple(r for r in layout.previous if r in layout.present and r not in excluded)
        order += tuple(sorted(layout.present - set(order) - excluded))
        return layout.replace(order=order)

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps:
    """Keep surviving ranks' numbers; move the highest-numbered ranks into the holes.

    With ``m`` usable ranks present, a rank whose previous position is below ``m`` keeps it;
    the others (spares first, as they come last in the previous order) fill the holes from
    the lowest hole up. So the data shard each rank number reads is unchanged when a spare
    replaces a lost rank.
    """

    def __call__(self, layout: Layout) -> Layout:
        excluded = set(layout.excluded)
        usable = [r for r in layout.previous if r in layout.present and r not in excluded]
        usable += sorted(layout.present - set(usable) - excluded)
        m = len(usable)
        position = {r: i for i, r in enumerate(layout.previous)}
        slots: list[int | None] = [None] * m
        movers = []
        for r in usable:
            p = position.get(r)
            if p is not None and p < m:
                slots[p] = r
            else:
                movers.append(r)
        movers.reverse()  # pop() takes the lowest-positioned mover first
        for i in range(m):
            if slots[i] is None:
                slots[i] = movers.pop()
        return layout.replace(order=tuple(r for r in slots if r is not None))

    def __repr__(self) -> str:
        return "FillGaps()"


class GroupedByKey:
    """Drop a whole group (e.g. a node) from the active ranks when any member is gone.

    Args:
        key: the name of a fact each rank reports (``"host"`` or ``"local_rank"``), or a
            callable ``initial_rank -> hashable`` (e.g. ``lambda r: r // 8``).
        size: the number of ranks of a complete group. Ranks of a group with fewer present
            members are excluded (they wait as spares) until a later round.
    """

    def __init__(self, key: str | Callable[[int], Hashable], size: int) -> None:
        if not (isinstance(key, str) or callable(key)):
            raise ConfigError("GroupedByKey(key=...) must be a fact name like 'host' or a callable")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"GroupedByKey(size={size!r}) must be an int >= 1")
        self.key = key
        self.size = size

    def _group(self, layout: Layout, rank: int) -> Hashable:
        if callable(self.key):
            return self.key(rank)
        facts = layout.info.get(rank, {})
        if self.key not in facts:
            raise ConfigError(
                f"GroupedByKey: rank {rank} reported no fact {self.key!r}; known: "
                f"{sorted(facts)}; pass a callable key instead"
            )
        return facts[self.key]

    def __call__(self, layout: Layout) -> Layout:
        groups: dict[Hashable, list[int]] = {}
        for r in sorted(layout.present):
            groups.setdefault(self._group(layout, r), []).append(r)
        dropped = {r for members in groups.values() if len(members) < self.size for r in members}
        if not dropped:
            return layout
        excluded = tuple(layout.excluded) + tuple(
            r for r in layout.order if r in dropped and r not in layout.excluded
        )
        return layout.replace(excluded=excluded)

    def __repr__(self) -> str:
        return f"GroupedByKey({self.key!r}, {self.size})"
