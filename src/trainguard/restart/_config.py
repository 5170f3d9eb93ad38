"""Validation of the Wrapper's arguments (all checked when the Wrapper is built)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainguard.errors import ConfigError
from trainguard.restart.policy.retry import RetryController


def seconds(name: str, value: object) -> float:
    """A timeout given as seconds or a ``timedelta``, as positive finite seconds."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: give seconds (a number) or a datetime.timedelta")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive, finite number of seconds")
    return float(value)


def policy(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise ConfigError(
            f"{name}={value!r} is not callable; pass a policy such as "
            "trainguard.restart.ShiftRanks() or a function"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    store: Any
    rank_assignment: Callable[[Any], Any]
    rank_filter: Callable[[Any], Any] | None
    initialize: Callable[[Any], Any] | None
    finalize: Callable[[Any], Any] | None
    health_check: Callable[[Any], Any] | None
    abort: Callable[[Any], Any] | None
    retry: RetryController | None
    barrier_timeout: float
    completion_timeout: float
    store_timeout: float
    abort_timeout: float
    soft_timeout: float
    hard_timeout: float
    termination_grace_time: float
    heartbeat_interval: float
    heartbeat_timeout: float
    sidecar: bool


def build(**kw: Any) -> Config:
    from trainguard.restart._session import check_store_arg
    from trainguard.restart.policy.assignment import ShiftRanks

    check_store_arg(kw["store"])
    barrier_timeout = seconds("barrier_timeout", kw["barrier_timeout"])
    completion_timeout = seconds("completion_timeout", kw["completion_timeout"])
    store_timeout = seconds("store_timeout", kw["store_timeout"])
    if store_timeout > barrier_timeout:
        raise ConfigError(
            f"store_timeout={store_timeout:g} s exceeds barrier_timeout={barrier_timeout:g} s: "
            "a barrier includes store operations, so lower store_timeout or raise barrier_timeout"
        )
    abort_timeout = seconds("abort_timeout", kw["abort_timeout"])
    if abort_timeout >= barrier_timeout:
        raise ConfigError(
            f"abort_timeout={abort_timeout:g} s must be shorter than barrier_timeout="
            f"{barrier_timeout:g} s: the others wait at the next barrier for a rank that is "
            "still being aborted; lower abort_timeout or raise barrier_timeout"
        )
    soft, hard, grace, interval, hb_timeout = (
        seconds(name, kw[name])
        for name in (
            "soft_timeout",
            "hard_timeout",
            "termination_grace_time",
            "heartbeat_interval",
            "heartbeat_timeout",
        )
    )
    if soft >= hard:
        raise ConfigError(
            f"soft_timeout={soft:g} s must be shorter than hard_timeout={hard:g} s: the soft "
            "timeout restarts a hung rank in-process, the hard timeout kills it when that "
            "failed; lower soft_timeout or raise hard_timeout"
        )
    if interval >= hb_timeout:
        raise ConfigError(
            f"heartbeat_timeout={hb_timeout:g} s must be longer than heartbeat_interval="
            f"{interval:g} s (several intervals, so one late beat is not a verdict); raise "
            "heartbeat_timeout or lower heartbeat_interval"
        )
    if interval >= soft:
        raise ConfigError(
            f"heartbeat_interval={interval:g} s must be shorter than soft_timeout={soft:g} s; "
            "lower heartbeat_interval"
        )
    if not isinstance(kw["sidecar"], bool):
        raise ConfigError(f"sidecar={kw['sidecar']!r}: pass True or False")
    retry = kw["retry"]
    max_rounds = kw["max_rounds"]
    if retry is not None and not isinstance(retry, RetryController):
        raise ConfigError(f"retry={retry!r}: pass a trainguard.restart.RetryController")
    if retry is not None and max_rounds is not None:
        raise ConfigError(
            "pass either max_rounds=... or retry=RetryController(...), not both: write "
            "retry=RetryController(max_rounds=..., min_active_world_size=...)"
        )
    if max_rounds is not None:
        retry = RetryController(max_rounds=max_rounds)
    return Config(
        store=kw["store"],
        rank_assignment=policy("rank_assignment", kw["rank_assignment"]) or ShiftRanks(),
        rank_filter=policy("rank_filter", kw["rank_filter"]),
        initialize=policy("initialize", kw["initialize"]),
        finalize=policy("finalize", kw["finalize"]),
        health_check=policy("health_check", kw["health_check"]),
        abort=policy("abort", kw["abort"]),
        retry=retry,
        barrier_timeout=barrier_timeout,
        completion_timeout=completion_timeout,
        store_timeout=store_timeout,
        abort_timeout=abort_timeout,
        soft_timeout=soft,
        hard_timeout=hard,
        termination_grace_time=grace,
        heartbeat_interval=interval,
        heartbeat_timeout=hb_timeout,
        sidecar=kw["sidecar"],
    )
