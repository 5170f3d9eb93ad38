"""Fixtures of the coord tests: a store process, a plain TCPStore, a server of either backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests._dist import free_port
from tests.coord import _helpers
from trainguard.coord import Keyspace, StoreProcess, connect


@pytest.fixture()
def make_store_process() -> Callable[..., StoreProcess]:
    """``make_store_process(job, port, world_size=2, timeout=30)``: a store process, not started."""
    return _helpers.store_process


@pytest.fixture()
def store_process(
    make_store_process: Callable[..., StoreProcess],
) -> Iterator[tuple[StoreProcess, Any]]:
    """A started store process of job ``t`` and a client of its coordination store; the test
    ends the job (its ``exit`` key) and the process must then exit cleanly."""
    port = free_port()
    server = make_store_process("t", port).start()
    client = connect("127.0.0.1", port, timeout=30)
    yield server, client
    client.set(Keyspace("t").exit, b"test over")
    server.close(timeout=10)
    assert server.proc is not None and server.proc.returncode == 0


@pytest.fixture()
def store() -> Iterator[Any]:
    """A TCPStore served by this process (clone it for each thread that waits)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    yield server
    del server


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A real TCPStore server (hosted by this process) of either backend."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        use_libuv=request.param,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )
    yield store
    del store
