"""Small composable policies of in-process restart.

- rank assignment (``Layout -> Layout``): :class:`ShiftRanks`, :class:`FillGaps`,
  :class:`GroupedByKey`;
- rank filter (``Layout -> Layout``): :class:`MaxActiveWorldSize`,
  :class:`ActiveWorldSizeDivisibleBy`;
- :class:`RetryController` (``Layout -> None``, raises to stop);
- :class:`Compose` chains any of these, and the hooks that receive a
  :class:`~trainguard.restart.state.RoundState`.
"""

from __future__ import annotations

from trainguard.restart.policy.assignment import FillGaps, GroupedByKey, ShiftRanks
from trainguard.restart.policy.compose import Compose
from trainguard.restart.policy.filter import ActiveWorldSizeDivisibleBy, MaxActiveWorldSize
from trainguard.restart.policy.layout import Layout
from trainguard.restart.policy.retry import RetryController

__all__ = [
    "ActiveWorldSizeDivisibleBy",
    "Compose",
    "FillGaps",
    "GroupedByKey",
    "Layout",
    "MaxActiveWorldSize",
    "RetryController",
    "ShiftRanks",
]
