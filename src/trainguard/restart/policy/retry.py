"""RetryController: when to give up restarting."""

from __future__ import annotations

from trainguard.errors import ConfigError, RetryLimitError
from trainguard.restart.policy.layout import Layout

__all__ = ["RetryController"]


class RetryController:
    """Stop the job when a round would exceed ``max_rounds`` or have too few active ranks.

    Called with the final layout of each round by the barrier's last arriver; a stop is
    published to every rank, which all raise the same :class:`RetryLimitError`.

    Args:
        max_rounds: the most rounds the job may run, the first included (None: no limit).
            ``max_rounds=1`` never restarts.
        min_active_world_size: the fewest active ranks a round may have.
    """

    def __init__(self, max_rounds: int | None = None, min_active_world_size: int = 1) -> None:
        if max_rounds is not None and (
            not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1
        ):
            raise ConfigError(
                f"RetryController(max_rounds={max_rounds!r}): expected an int >= 1 or None"
            )
        if (
            not isinstance(min_active_world_size, int)
            or isinstance(min_active_world_size, bool)
            or min_active_world_size < 1
        ):
            raise ConfigError(
                "RetryController(min_active_world_size="
                f"{min_active_world_size!r}): expected an int >= 1"
            )
        self.max_rounds = max_rounds
        self.min_active_world_size = min_active_world_size

    def __call__(self, layout: Layout) -> None:
        if self.max_rounds is not None and layout.round >= self.max_rounds:
            raise RetryLimitError(
                f"round {layout.round} would exceed max_rounds={self.max_rounds}; raise "
                "max_rounds or fix the fault that keeps recurring"
            )
        active = len(layout.active)
        if active < self.min_active_world_size:
            raise RetryLimitError(
                f"round {layout.round} would have {active} active rank(s), fewer than "
                f"min_active_world_size={self.min_active_world_size}"
            )

    def __repr__(self) -> str:
        return (
            f"RetryController(max_rounds={self.max_rounds}, "
            f"min_active_world_size={self.min_active_world_size})"
        )
