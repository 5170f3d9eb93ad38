"""Rank function of the job-secret test (module level, so spawned ranks can import it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import trainguard.restart as tr
from tests.restart._faults import watcher_pids


def secret_job() -> dict[str, Any]:
    """One round; reports what the store holds with and without the secret in key names."""
    port = int(os.environ["MASTER_PORT"])  # in the round, MASTER_PORT names the round's store

    @tr.Wrapper(store_timeout=30, barrier_timeout=60)
    def fn(call: tr.CallWrapper) -> dict[str, Any]:
        from trainguard.coord import _secret, connect

        secret = _secret.current()
        store = connect(os.environ["MASTER_ADDR"], port, timeout=30)
        job = os.environ["TRAINGUARD_JOB_ID"]
        handover = f"tg/{job}/0/secret"
        (sidecar,) = watcher_pids(os.environ["TG_TEST_JOB"])  # the node's, detached
        return {
            "secret": secret,
            "with": store.check([f"tg/{job}/0/{secret}/r0/ready"]),
            "without": store.check([f"tg/{job}/0/r0/ready"]),
            "handover": bytes(store.get(handover)).decode() if store.check([handover]) else None,
            "digest": hashlib.sha256(secret.encode()).hexdigest(),
            "in_cmdline": secret.encode() in Path(f"/proc/{sidecar}/cmdline").read_bytes(),
        }

    value: dict[str, Any] = fn()
    return value


def forged_complete_job() -> int:
    """One round: rank 1 writes a forged "complete" outcome of round 0 into the real store
    (with the job's secret: what a writer who learned it could do), then raises."""
    port = int(os.environ["MASTER_PORT"])  # the coordination store (before the round's)

    @tr.Wrapper(store_timeout=30, barrier_timeout=60)
    def fn(call: tr.CallWrapper) -> int:
        from trainguard.coord import Keyspace, _secret, connect
        from trainguard.restart.state import RoundOutcome

        if call.state.initial_rank == 1:
            keys = Keyspace(os.environ["TRAINGUARD_JOB_ID"], 0, _secret.current())
            store = connect(os.environ["MASTER_ADDR"], port, timeout=30)
            store.set(keys.stop(0), RoundOutcome.complete().encode())
            raise ValueError("rank 1 failed in round 0")
        return 7

    value: int = fn()
    return value
