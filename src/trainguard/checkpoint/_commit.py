"""Commit of a multi-rank checkpoint, counted in a torch.distributed Store.

Every rank calls :func:`report` once per checkpoint, after its part is durable or has failed.
The protocol costs each rank O(1) store operations (plus one ``check`` per rank for the last
arriver), uses no collective on the training process group, and decides the outcome once::

    rank r failed    -> set  P/err/r = reason
    every rank       -> n = add(P/count, 1)
    the rank with n == world_size (the last to arrive) decides:
        no err/* key -> write the commit marker (tmp, fsync, rename, fsync dir)
        set P/outcome = {"ok": ..., "causes": {rank: reason}}
    every rank       -> wait(P/outcome) and read it
    every rank       -> add(P/seen, 1); the last one deletes P's keys

The outcome is set with ``compare_set`` (first writer wins), so :func:`abandon` (a rank that
gives the checkpoint up, e.g. after a restart made it moot) wakes every waiting rank at once
with a failure instead of leaving them to wait for a dead rank until ``timeout``.

The store client given must not be shared with a thread that needs it meanwhile: ``wait``
holds a TCPStore client for its whole duration (pass ``store.clone()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Any

from trainguard.checkpoint.fileformat import fsync_dir

MARKER = "COMMITTED"


def write_marker(directory: str, info: dict[str, Any]) -> None:
    """Atomically create ``directory/COMMITTED`` holding ``info`` as JSON, durably."""
    path = os.path.join(directory, MARKER)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(directory)


def remove_marker(directory: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, MARKER))


def report(
    store: Any,
    prefix: str,
    *,
    rank: int,
    world_size: int,
    error: str | None,
    directory: str,
    marker_info: dict[str, Any],
    timeout: float,
) -> dict[int, str]:
    """Report this rank's result and wait for the outcome; returns failed rank -> reason.

    An empty result means the checkpoint is committed (the marker exists). A timeout means some
    rank never reported (it died or hangs): the missing ranks are named as causes.
    """
    if error is not None:
        store.set(f"{prefix}/err/{rank}", error)
    store.set(f"{prefix}/done/{rank}", "1")
    arrived = store.add(f"{prefix}/count", 1)
    if arrived == world_size:
        causes: dict[int, str] = {}
        for r in range(world_size):
            if store.check([f"{prefix}/err/{r}"]):
                causes[r] = store.get(f"{prefix}/err/{r}").decode(errors="replace")
        if not causes:
            try:
                write_marker(directory, {**marker_info, "time": time.time()})
            except OSError as exc:
                causes[rank] = f"commit marker could not be written: {exc}"
        decision = json.dumps({"causes": causes})
        if _decide(store, prefix, decision) != decision and not causes:
            remove_marker(directory)  # a rank abandoned this checkpoint first: not committed
    try:
        store.wait([f"{prefix}/outcome"], timedelta(seconds=timeout))
    except Exception as exc:  # DistStoreError on timeout; name who never reported
        missing = [r for r in range(world_size) if not store.check([f"{prefix}/done/{r}"])]
        return {
            r: f"did not report its part within {timeout} s (died or hung?)" for r in missing
        } or {rank: f"waiting for the commit outcome failed: {exc}"}
    outcome = json.loads(store.get(f"{prefix}/outcome"))
    if store.add(f"{prefix}/seen", 1) == world_size:
        keys = ["count", "outcome", "seen"] + [
            f"{kind}/{r}" for r in range(world_size) for kind in ("err", "done")
        ]
        for key in keys:
            with contextlib.suppress(Exception):
                store.delete_key(f"{prefix}/{key}")
    return {int(r): str(v) for r, v in outcome["causes"].items()}


def _decide(store: Any, prefix: str, outcome: str) -> str:
    """Set ``P/outcome`` unless it is set already; returns the outcome that holds."""
    held = store.compare_set(f"{prefix}/outcome", "", outcome)
    return held.decode() if isinstance(held, bytes) else str(held)


def abandon(store: Any, prefix: str, *, rank: int, reason: str) -> bool:
    """Fail the checkpoint at ``prefix`` on every rank unless its outcome is decided already.

    Returns True when this call decided it. Ranks waiting in :func:`report` wake at once and
    see ``reason`` as this rank's cause; the commit marker is never written (or is removed)."""
    outcome = json.dumps({"causes": {str(rank): reason}})
    return _decide(store, prefix, outcome) == outcome
