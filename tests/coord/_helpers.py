"""Helpers for the coord tests, also for the ones that must run in another process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.coord.store import StoreProcess


def store_process(job: str, port: int, *, world_size: int = 2, timeout: float = 30) -> StoreProcess:
    """A store process (not started) hosting job ``job``'s coordination store on ``port``."""
    return StoreProcess(
        job=job,
        call=0,
        coord_host="127.0.0.1",
        coord_port=port,
        host_coord=True,
        advertise_host="127.0.0.1",
        world_size=world_size,
        timeout=timeout,
    )


def host_store_then_hang(job: str, port: int, conn: Any) -> None:
    server = store_process(job, port).start()
    assert server.proc is not None
    conn.send(server.proc.pid)
    time.sleep(600)  # killed by the test


def in_threads(fn: Callable[[int], Any], n: int) -> dict[int, Any]:
    """``fn(rank)`` for each of ``n`` participants, each in a thread; rank -> its result."""
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:  # the test looks at it
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def launch_rank0_then_hang(job: str, port: int, conn: Any) -> None:
    """A launcher (the store process's owner): starts a rank 0 that starts the store process
    (:func:`host_store_then_hang`); sends that rank's pid, then the store process's."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    rank0 = ctx.Process(target=host_store_then_hang, args=(job, port, conn))
    rank0.start()
    conn.send(rank0.pid)
    time.sleep(600)  # killed by the test
