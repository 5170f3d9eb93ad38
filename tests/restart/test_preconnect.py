"""The next round's store client, connected ahead while this round's group is being built,
survives this round's abort.

The pre-connect thread's new connection may appear while the main thread builds a process
group, so the group's constructor records it as one of the group's sockets; an abort shuts those
down. The connection used to be excluded only once its connect had returned: an abort that
landed in between shut the client down, and the next round's ``init_process_group`` failed
with ``Broken pipe`` (``test_spare_moves_in_only_when_a_health_check_fails`` under two CPU hogs,
about one run in ten). Here that order is made certain: the group is built while the connect
runs, and the abort comes as the connect returns.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests._dist import run_ranks


def _abort_as_the_connect_returns(coord_port: int, next_port: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from trainguard.coord.keys import Keyspace
    from trainguard.restart import _preconnect
    from trainguard.restart.abort import GroupSockets, release_group_sockets

    coord = dist.TCPStore("127.0.0.1", coord_port, is_master=False, use_libuv=True)
    keys = Keyspace("race")
    connected, aborted = threading.Event(), threading.Event()
    real_connect, real_build = _preconnect.connect, c10d._new_process_group_helper

    def connect(*args: Any, **kwargs: Any) -> Any:
        store = real_connect(*args, **kwargs)
        connected.set()
        aborted.wait(30)  # the abort lands just as the connect returns
        return store

    def build(*args: Any, **kwargs: Any) -> Any:  # the real constructor, with the connect in it
        ahead.ahead(1)
        connected.wait(30)
        return real_build(*args, **kwargs)

    _preconnect.connect = connect  # type: ignore[assignment]
    c10d._new_process_group_helper = build
    GroupSockets.install()
    ahead = _preconnect.Preconnect(coord, keys, timeout=30)
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        taken = GroupSockets.take()  # round 0 is aborted
        release_group_sockets(taken)
        aborted.set()
        client = _preconnect.claim("127.0.0.1", next_port, 30)
        assert client is not None, "the client made ahead was not there to claim"
        client.set("round 1", b"works")  # used to fail: Broken pipe
        return {"value": bytes(client.get("round 1")), "taken": len(taken)}
    finally:
        aborted.set()
        ahead.close(10)
        dist.destroy_process_group()
        GroupSockets.uninstall()
        c10d._new_process_group_helper = real_build


def test_the_next_round_s_client_survives_an_abort_as_its_connect_returns() -> None:
    import torch.distributed as dist

    from trainguard.coord.keys import Keyspace

    def server() -> Any:  # in this process, as the store process hosts them: not the rank's
        return dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)

    coord, next_round = server(), server()
    coord.set(Keyspace("race").pg_addr(1), f"127.0.0.1:{next_round.port}")
    (result,) = run_ranks(
        _abort_as_the_connect_returns, 1, args=(coord.port, next_round.port), timeout=60
    )
    assert result.get()["value"] == b"works"
    assert bytes(next_round.get("round 1")) == b"works"


def test_a_round_waits_for_a_client_made_ahead_no_longer_than_that_connect_s_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Something that is not a store answers on the next round's published port (a silent
    listener: it accepts and never replies). torch's client then hangs past its timeout in the
    worker thread. The round's ``init_process_group`` used to wait for that connect for the
    group's whole timeout (30 min by default), so the watchdog took the round for a hang and
    restarted it; it now gives up at the connect's own bound and connects as usual."""
    import socket
    import time

    import torch.distributed as dist

    from trainguard.coord.keys import Keyspace
    from trainguard.restart import _preconnect

    monkeypatch.setattr(_preconnect, "_CONNECT_S", 1.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    keys = Keyspace("silent", 0)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store.set(keys.pg_addr(1), f"127.0.0.1:{port}")
    accepted: list[socket.socket] = []
    ahead = _preconnect.Preconnect(store.clone(), keys, timeout=30.0)
    try:
        ahead.ahead(1)
        listener.settimeout(20)
        accepted.append(listener.accept()[0])  # the probe's connection
        accepted.append(listener.accept()[0])  # torch's client: it waits for a reply
        accepted[-1].settimeout(20)
        got = b""
        while len(got) < 10:  # its validation and ping (as a gloo listener reads them)
            got += accepted[-1].recv(64)
        start = time.monotonic()
        client = _preconnect.claim("127.0.0.1", port, 30.0)
        waited = time.monotonic() - start
        assert client is None
        assert waited < 5.0, waited  # its bound is 1.5 s here, not the 30 s asked for
        assert _preconnect.claim("127.0.0.1", port, 30.0) is None  # given up on: not handed out
    finally:
        for conn in accepted:
            conn.close()  # torch's client sees the end of the stream and gives up
        listener.close()
        ahead.close(10.0)
    assert not ahead._thread.is_alive()
