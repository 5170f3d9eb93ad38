"""Helpers for the coord tests, also for the ones that must run in another process."""

from __future__ import annotations

import time

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


def host_store_then_hang(job: str, port: int, conn) -> None:
    server = store_process(job, port).start()
    assert server.proc is not None
    conn.send(server.proc.pid)
    time.sleep(600)  # killed by the test
