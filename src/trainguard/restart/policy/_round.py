"""The policies that lay a round out, applied in their fixed order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from trainguard.errors import RetryLimitError
from trainguard.restart.policy.assignment import ShiftRanks
from trainguard.restart.policy.layout import Layout
from trainguard.restart.policy.retry import RetryController

#: a rank assignment or rank filter policy.
Policy = Callable[[Layout], Layout]


@dataclasses.dataclass(frozen=True)
class RoundPolicies:
    """The Wrapper's rank assignment, rank filter and retry controller, and the longest run
    of rounds failing the same way that is restarted (``max_repeated_faults``, see
    :mod:`trainguard.restart._repeat`).

    Whoever lays a round out (the barrier's last arriver, or a sidecar writing a death notice)
    calls :meth:`apply`; the sidecar receives them pickled.
    """

    rank_assignment: Policy = dataclasses.field(default_factory=ShiftRanks)
    rank_filter: Policy | None = None
    retry: RetryController | None = None
    max_repeated_faults: int | None = 3
    #: a :class:`~trainguard.restart.quarantine.Quarantine` (typed loosely: this package
    #: does not import the restart package above it), or None.
    quarantine: Any = None

    def apply(self, layout: Layout) -> Layout:
        """Assignment, then filter, then the retry controller.

        Raises :class:`RetryLimitError` when the job must stop (the retry controller said so,
        or the filter left no active rank among present ranks); a policy's own exception
        propagates.
        """
        layout = self.rank_assignment(layout)
        if self.rank_filter is not None:
            layout = self.rank_filter(layout)
        if self.retry is not None:
            self.retry(layout)
        if layout.present and not layout.active:
            raise RetryLimitError(
                f"round {layout.round}: the rank filter left no active rank among "
                f"{sorted(layout.present)}"
            )
        return layout
