"""Rank filter policies: decide how many of the ordered ranks are active; the rest are spares.

Each is a callable ``Layout -> Layout`` that lowers ``active_count``. Spares wait idle in the
wrapper and are activated in a later round, when the filter lets more ranks in.
"""

from __future__ import annotations

from trainguard.errors import ConfigError
from trainguard.restart.policy.layout import Layout

__all__ = ["ActiveWorldSizeDivisibleBy", "MaxActiveWorldSize"]


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}({value!r}): expected an int >= 1")
    return value


def _current(layout: Layout) -> int:
    n = len(layout.candidates)
    return n if layout.active_count is None else min(n, layout.active_count)


class MaxActiveWorldSize:
    """At most ``n`` active ranks (the first ``n`` in rank order)."""

    def __init__(self, n: int) -> None:
        self.n = _positive("MaxActiveWorldSize", n)

    def __call__(self, layout: Layout) -> Layout:
        return layout.replace(active_count=min(_current(layout), self.n))

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.n})"


class ActiveWorldSizeDivisibleBy:
    """The active world size is the largest multiple of ``m`` that fits (possibly 0)."""

    def __init__(self, m: int) -> None:
        self.m = _positive("ActiveWorldSizeDivisibleBy", m)

    def __call__(self, layout: Layout) -> Layout:
        return layout.replace(active_count=_current(layout) // self.m * self.m)

    def __repr__(self) -> str:
        return f"ActiveWorldSizeDivisibleBy({self.m})"
