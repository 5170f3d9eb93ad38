"""Waiting on keys and counting barriers over a ``torch.distributed.Store``.

A barrier is one ``add()`` per arriving rank plus one ``wait()`` on a completion key that the
last arriver sets, so every rank wakes within one store round trip of the last arrival and
no rank polls. The number of expected arrivals is decided by the caller (ranks known to be
gone are simply not expected).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainguard.errors import BarrierTimeoutError, CoordinationError

__all__ = ["arrive", "wait_forever", "wait_key"]

_LONG = timedelta(days=1)


def _is_timeout(exc: BaseException) -> bool:
    return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()


def wait_key(store: Any, key: str, timeout: float, *, what: str = "") -> bytes:
    """Block until ``key`` is set (woken by the store, no polling) and return its value.

    Raises :class:`CoordinationError` naming ``what`` after ``timeout`` seconds.
    """
    try:
        store.wait([key], timedelta(seconds=timeout))
        return bytes(store.get(key))
    except Exception as exc:
        if _is_timeout(exc):
            raise BarrierTimeoutError(
                f"{what or key} did not complete within {timeout:g} s; a rank may be stuck or "
                "gone: raise the timeout or look at the other ranks' logs"
            ) from exc
        raise CoordinationError(f"store failed while waiting for {what or key}: {exc}") from exc


def wait_forever(store: Any, key: str) -> bytes:
    """Block until ``key`` is set, however long that takes (in one-day waits)."""
    while True:
        try:
            store.wait([key], _LONG)
            return bytes(store.get(key))
        except Exception as exc:
            if not _is_timeout(exc):
                raise


def arrive(
    store: Any,
    counter: str,
    done: str,
    expected: int,
    *,
    on_last: Callable[[], bytes],
    timeout: float,
    what: str = "barrier",
) -> tuple[bytes, bool, float]:
    """Count this rank in at ``counter`` and wait for ``done``.

    The rank whose ``add`` makes the count reach ``expected`` calls ``on_last()`` and sets
    ``done`` to what it returns. Returns ``(value of done, was_last, seconds waited)``.
    Every expected rank calls this once per barrier.
    """
    start = time.monotonic()
    count = int(store.add(counter, 1))
    if count > expected:
        raise CoordinationError(
            f"{what}: {count} arrivals for {expected} expected; two jobs share a job token? "
            "set TRAINGUARD_JOB_ID to a value unique to the job"
        )
    if count == expected:
        value = on_last()
        store.set(done, value)
        return value, True, time.monotonic() - start
    value = wait_key(store, done, timeout, what=what)
    return value, False, time.monotonic() - start
