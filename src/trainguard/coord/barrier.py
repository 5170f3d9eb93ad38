"""Waiting on keys of a ``torch.distributed.Store``, woken by the store (no polling).

A ``Store.wait()`` on a client of its own wakes within one store round trip of the key being
set. A wait that runs out of time raises ``torch.distributed.DistStoreError`` (torch 2.13: the
store's timeouts; a lost connection raises ``DistNetworkError`` instead), which is how a timeout
is told apart from a store that failed. Counting protocols built on these waits live in
:mod:`trainguard.coord.commit` (report, decide once) and :mod:`trainguard.coord.gather`.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from trainguard.coord.store import StoreLike
from trainguard.errors import BarrierTimeoutError, CoordinationError, StoreTimeoutError

__all__ = ["late", "timed_out", "wait_all", "wait_forever", "wait_key"]

_LONG = timedelta(days=1)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a store operation, says the operation ran out of time.

    torch raises ``DistStoreError`` for a store timeout; other failures (a lost connection:
    ``DistNetworkError``) are not timeouts. The pure-Python client (:mod:`._wire`) raises
    :class:`~trainguard.errors.StoreTimeoutError`. A process that has not imported
    ``torch.distributed`` cannot have got torch's error, and this never imports it.
    """
    if isinstance(exc, StoreTimeoutError):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(exc, dist.DistStoreError)


# the name wait_forever uses
_is_timeout = timed_out


def wait_all(store: StoreLike, keys: list[str], timeout: float, *, what: str = "") -> bool:
    """Block until every key of ``keys`` is set (woken by the store): True; False after
    ``timeout`` seconds. Any other store failure raises :class:`CoordinationError`."""
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return True
    except Exception as exc:
        if timed_out(exc):
            return False
        raise CoordinationError(f"store failed while waiting for {what or keys[0]}: {exc}") from exc


_ABSENT = "\x00absent"  # compare_set's expected value for a key that no value equals


def read_set(store: StoreLike, key: str) -> bytes | None:
    """The value of ``key``, which a wait just found set; None if it was deleted since.

    One store round trip: ``compare_set`` with an expected value that no value equals
    returns the value and changes nothing. (``get`` would first wait for the key again: a
    second round trip, for every rank at every barrier.)

    When the key is not set, that ``compare_set`` wakes every client waiting for it (torch
    2.13's server), although nothing was set. Those clients, reading in turn, would wake each
    other for as long as the key stays unset: :func:`_read_woken` reads with a ``check``
    first once a wake proved false."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT.encode() else value


def _read_woken(store: StoreLike, key: str, wary: bool) -> bytes | None:
    """The value of ``key`` after a wait for it returned; None when it is not set (a false
    wake, or deleted since). ``wary``: a wake of this wait proved false before, so look
    (``check``, which wakes nobody) before reading."""
    if wary and not store.check([key]):
        return None
    return read_set(store, key)


def late(what: str, timeout: float) -> BarrierTimeoutError:
    """The error of a wait for ``what`` that ran out of its ``timeout`` seconds."""
    return BarrierTimeoutError(
        f"{what} did not complete within {timeout:g} s; a rank may be stuck or gone: raise "
        "the timeout or look at the other ranks' logs"
    )


def wait_key(store: StoreLike, key: str, timeout: float, *, what: str = "") -> bytes:
    """Block until ``key`` is set (woken by the store, no polling) and return its value.

    Raises :class:`BarrierTimeoutError` naming ``what`` after ``timeout`` seconds. A wake
    that finds the key unset (see :func:`read_set`) waits again, in the same ``timeout``.
    """
    deadline, left = time.monotonic() + timeout, timeout
    wary = False
    while True:
        if left <= 0 or not wait_all(store, [key], left, what=what):
            raise late(what or key, timeout)
        try:
            value = _read_woken(store, key, wary)
        except Exception as exc:
            raise CoordinationError(f"store failed while reading {what or key}: {exc}") from exc
        if value is not None:
            return value
        wary, left = True, deadline - time.monotonic()


def wait_forever(store: StoreLike, key: str) -> bytes:
    """Block until ``key`` is set, however long that takes (in one-day waits)."""
    wary = False
    while True:
        try:
            store.wait([key], _LONG)
            value = _read_woken(store, key, wary)
            if value is not None:
                return value
            wary = True
        except Exception as exc:
            if not _is_timeout(exc):
                raise
