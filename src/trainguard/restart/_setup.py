"""A bound on the connect phase of a process group's constructor, so no abort ends its rank.

gloo's constructor (``ProcessGroupGloo``, torch 2.13) exchanges addresses through the store and
then connects every pair; on one side of each pair it waits for the peer to connect to it.
When the peer published its address but never connects (a slow link, a stopped process, a
peer that aborted its own half-built group), nothing of the abort reaches that wait (the rank
has no socket of its own to shut down, and gloo's listener must not be shut), and it lasts
five times the group's timeout (measured: 2 s gave 10 s, 15 s gave 75 s; the default timeout
is 30 min). The monitor then took the rank for stuck and ended the process, whatever state
it held (issue 40, item 7).

So while the wrapper runs, a group whose backend connects in its constructor (gloo, not its
lazy mode; NCCL connects at the first collective and is left as it is) is built in two parts,
by :func:`build`, called from the constructor's wrapper (:class:`~.abort.GroupSockets`):

1. every member of the group arrives at a barrier on the group's store (a counter and a
   release key under ``trainguard/pg_setup/<group name>``; each construction on that store
   is one generation) with the group's own timeout: a late peer is waited for as long as
   before, and the abort releases this wait by shutting down the store's connection
   (``WrappedCall._aborted``);
2. the constructor runs with its timeout lowered to :attr:`SetupBound.connect_s` (the
   wrapper's ``abort_timeout``): everyone is there, so the exchange and the connects take
   milliseconds; a peer that does not connect makes it raise within
   :data:`GLOO_CONNECT_FACTOR` times that bound. Right after, the group's collective timeout
   is set back to the one asked for (``_torchcompat.set_group_timeout``).

While part 2 runs, :func:`connecting_until` gives the monitor the moment by which the
constructor has returned or raised: the monitor waits that long (plus ``abort_timeout``)
before it takes the rank for stuck, so the rank leaves its round normally and takes part in
the next one with the state it holds.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from datetime import timedelta
from typing import Any

from trainguard import _torchcompat
from trainguard.coord.store import StoreLike

__all__ = ["GLOO_CONNECT_FACTOR", "SetupBound", "build", "connecting_until"]

logger = logging.getLogger(__name__)

#: gloo (torch 2.13) waits up to this many times the group's timeout for a peer to connect to
#: it (tests/test_torchcompat.py measures it on the installed torch)
GLOO_CONNECT_FACTOR = 5

_PREFIX = "trainguard/pg_setup/"


class SetupBound:
    """The process-wide bound (:meth:`push`/:meth:`pop` nest: the innermost wrapped call's)."""

    _lock = threading.Lock()
    _bounds: list[float | None] = []  # noqa: RUF012 - process-wide on purpose
    _connecting: dict[int, float] = {}  # noqa: RUF012 - thread id -> when it may end

    @classmethod
    def push(cls, connect_s: float | None) -> None:
        with cls._lock:
            cls._bounds.append(connect_s)

    @classmethod
    def pop(cls) -> None:
        with cls._lock:
            if cls._bounds:
                cls._bounds.pop()

    @classmethod
    def connect_s(cls) -> float | None:
        """The bound on a constructor's connect phase now, None outside the wrapper."""
        with cls._lock:
            return cls._bounds[-1] if cls._bounds else None


def connecting_until(thread_id: int) -> float | None:
    """When the bounded constructor ``thread_id`` runs now has returned or raised at the
    latest (``time.monotonic()``), None when it runs none."""
    with SetupBound._lock:
        return SetupBound._connecting.get(thread_id)


_signature: inspect.Signature | None = None


def build(original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``original(*args, **kwargs)`` (torch's ``_new_process_group_helper``), in two parts when
    the bound applies (see the module docstring)."""
    global _signature
    bound = SetupBound.connect_s()
    if bound is None:
        return original(*args, **kwargs)
    if _signature is None:
        _signature = inspect.signature(original)
    try:
        call = _signature.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)
    params = call.arguments
    timeout = params.get("timeout")
    if not _applies(params, timeout, bound):
        return original(*args, **kwargs)
    assert isinstance(timeout, timedelta)
    _arrive(params["store"], str(params["group_name"]), int(params["group_size"]), timeout)
    params["timeout"] = timedelta(seconds=bound)
    tid = threading.get_ident()
    with SetupBound._lock:
        SetupBound._connecting[tid] = time.monotonic() + GLOO_CONNECT_FACTOR * bound
    try:
        result = original(*call.args, **call.kwargs)
    finally:
        with SetupBound._lock:
            SetupBound._connecting.pop(tid, None)
    group = result[0] if isinstance(result, tuple) else result
    if _torchcompat.is_group(group):
        _torchcompat.set_group_timeout(group, timeout)
    return result


def _applies(params: dict[str, Any], timeout: object, bound: float) -> bool:
    """Whether this construction is bounded: a gloo group of 2 ranks or more that this rank
    is a member of, asked for a longer timeout than the bound, with no tag (a tagged group
    may be an existing one, built by nobody)."""
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= bound:
        return False
    if params.get("pg_tag") not in (None, ""):
        return False
    size = params.get("group_size")
    if not isinstance(size, int) or size < 2:
        return False
    ranks = params.get("global_ranks_in_group") or []
    if ranks and not _torchcompat.is_member(ranks):
        return False
    return _torchcompat.connects_in_constructor(params.get("backend"))


def _arrive(store: StoreLike, name: str, size: int, timeout: timedelta) -> None:
    """Wait (up to ``timeout``) until the ``size`` members of group ``name`` are all here:
    arrival ``k`` (1, 2, ...) belongs to generation ``(k - 1) // size``; the last of a
    generation sets its release key."""
    key = f"{_PREFIX}{name}"
    arrival = int(store.add(key, 1))
    generation = (arrival - 1) // size
    release = f"{key}/{generation}"
    if arrival % size == 0:
        store.set(release, b"1")
    else:
        store.wait([release], timeout)
