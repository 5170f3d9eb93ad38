"""Helpers for the coord tests that must run in another process."""

from __future__ import annotations

import time

from trainguard.coord.store import StoreProcess


def host_store_then_hang(job: str, port: int, conn) -> None:
    server = StoreProcess(
        job=job,
        call=0,
        coord_host="127.0.0.1",
        coord_port=port,
        host_coord=True,
        advertise_host="127.0.0.1",
        world_size=2,
        timeout=30,
    ).start()
    assert server.proc is not None
    conn.send(server.proc.pid)
    time.sleep(600)  # killed by the test
