"""The value that rank assignment and rank filter policies transform: :class:`Layout`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType


def _frozen(mapping: Mapping[int, Mapping[str, str]]) -> Mapping[int, Mapping[str, str]]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in mapping.items()})


@dataclasses.dataclass(frozen=True)
class Layout:
    """Who takes part in a round and in which rank order (immutable; policies return copies).

    The barrier's last arriver builds the initial layout and applies the assignment policy,
    then the filter policy, then the retry controller; the result is published to every rank.

    Attributes:
        round: the round being laid out (0 first).
        initial_world_size: number of ranks the job started with.
        previous: the previous round's order, active ranks first then spares (initial ranks);
            for round 0, ``0 .. initial_world_size-1``.
        present: initial ranks that arrived at this round's barrier and stay in the job.
        order: initial ranks in rank order (index = rank); set by assignment policies.
        excluded: present ranks that must not be active this round (they wait as spares).
        active_count: how many of ``order`` are active (the rest are spares); None = all.
        info: per initial rank, facts it reported at the barrier (``host``, ``local_rank``).
    """

    round: int
    initial_world_size: int
    previous: tuple[int, ...]
    present: frozenset[int]
    order: tuple[int, ...] = ()
    excluded: tuple[int, ...] = ()
    active_count: int | None = None
    info: Mapping[int, Mapping[str, str]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )

    @classmethod
    def start(
        cls,
        *,
        round: int,
        initial_world_size: int,
        previous: Sequence[int],
        present: frozenset[int] | set[int],
        info: Mapping[int, Mapping[str, str]] | None = None,
    ) -> Layout:
        """The layout before any policy: ``order`` keeps the previous order of present ranks."""
        present = frozenset(present)
        order = tuple(r for r in previous if r in present)
        order += tuple(sorted(present - set(order)))
        return cls(
            round=round,
            initial_world_size=initial_world_size,
            previous=tuple(previous),
            present=present,
            order=order,
            info=_frozen(info or {}),
        )

    def replace(self, **changes: object) -> Layout:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def candidates(self) -> tuple[int, ...]:
        """Present ranks that may be active, in the previous order."""
        excluded = set(self.excluded)
        return tuple(r for r in self.order if r not in excluded)

    @property
    def active(self) -> tuple[int, ...]:
        """Active initial ranks in rank order."""
        order = self.candidates
        count = len(order) if self.active_count is None else min(self.active_count, len(order))
        return order[:count]

    @property
    def spares(self) -> tuple[int, ...]:
        """Present ranks that wait idle this round: filtered out, then excluded."""
        active = set(self.active)
        rest = tuple(r for r in self.order if r not in active and r not in self.excluded)
        return rest + tuple(r for r in self.excluded if r not in rest)
