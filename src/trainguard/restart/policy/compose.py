"""Compose: chain small policies into one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.errors import ConfigError

__all__ = ["Compose"]


class Compose:
    """Call ``policies`` in order, each on the result of the one before.

    A policy that returns None passes its input on unchanged, so hooks that only act
    (``initialize``, ``finalize``, ``health_check``, ``abort``) compose as well as policies
    that transform a layout (rank assignment, rank filter).
    """

    def __init__(self, *policies: Callable[[Any], Any]) -> None:
        for p in policies:
            if not callable(p):
                raise ConfigError(f"Compose: {p!r} is not callable; pass policy objects")
        self.policies = tuple(policies)

    def __call__(self, value: Any) -> Any:
        for policy in self.policies:
            result = policy(value)
            if result is not None:
                value = result
        return value

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.policies))})"
