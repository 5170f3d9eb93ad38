"""Timeouts as every public object takes them: seconds or a ``timedelta``, checked in order.

One place for the rule the whole library follows: a timeout argument is keyword-only, accepts a
number of seconds or a :class:`datetime.timedelta`, is positive and finite, and its relation to
the other timeouts of the same object (shorter than, longer than) is checked when the object is
built, with a :class:`~trainguard.errors.ConfigError` that names the fix.
"""

from __future__ import annotations

import math
from datetime import timedelta

from trainguard.errors import ConfigError

__all__ = ["Timeout", "optional_seconds", "seconds", "shorter"]

#: what a timeout argument may be.
Timeout = float | int | timedelta


def seconds(name: str, value: object) -> float:
    """``value`` (seconds or a ``timedelta``) as positive, finite seconds; ``name`` for errors."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: give seconds (a number) or a datetime.timedelta")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive, finite number of seconds")
    return float(value)


def optional_seconds(name: str, value: object) -> float | None:
    """Like :func:`seconds`, but ``None`` (wait without a bound) stays ``None``."""
    return None if value is None else seconds(name, value)


def shorter(
    short_name: str, short: float, long_name: str, long: float, why: str, *, equal: bool = False
) -> None:
    """Check ``short < long`` (``<=`` with ``equal``); the error says ``why`` and how to fix it."""
    if short < long or (equal and short == long):
        return
    relation = "at most" if equal else "shorter than"
    raise ConfigError(
        f"{short_name}={short:g} s must be {relation} {long_name}={long:g} s: {why}; lower "
        f"{short_name} or raise {long_name}"
    )
