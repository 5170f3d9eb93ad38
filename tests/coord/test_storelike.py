"""``StoreLike``, the store interface of the coordination code: torch's ``TCPStore`` and
``PrefixStore`` and the pure-Python ``WireStore`` all satisfy it, and each of its operations
means the same on each of them against a real TCPStore server (both backends)."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

from trainguard.coord import _wire
from trainguard.coord.store import StoreLike


def _clients(server: Any) -> dict[str, Any]:
    import torch.distributed as dist

    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    return {
        "TCPStore": tcp,
        "PrefixStore": dist.PrefixStore("p", tcp),
        "WireStore": _wire.connect("127.0.0.1", server.port, timeout=30),
    }


def _exercise(store: StoreLike, name: str) -> None:
    """Every operation of the protocol, called positionally as the coordination code does."""
    key = f"k/{name}"
    store.set(key, b"v1")
    store.set(key + "s", "text")
    assert bytes(store.get(key)) == b"v1" and bytes(store.get(key + "s")) == b"text"
    assert store.add(key + "n", 2) == 2 and store.add(key + "n", 3) == 5
    assert bytes(store.compare_set(key + "c", "", b"first")) == b"first"
    assert bytes(store.compare_set(key + "c", "", b"second")) == b"first"
    assert store.check([key, key + "c"]) and not store.check([key + "missing"])
    store.wait([key], timedelta(seconds=5))
    assert [bytes(v) for v in store.multi_get([key, key + "c"])] == [b"v1", b"first"]
    store.append(key + "a", b"one,")
    store.append(key + "a", "two")
    assert bytes(store.get(key + "a")) == b"one,two"
    assert store.delete_key(key) and not store.check([key])


def test_torch_stores_and_the_wire_client_satisfy_store_like(server: Any) -> None:
    clients = _clients(server)
    for name, client in clients.items():
        assert isinstance(client, StoreLike), name
        _exercise(client, name)
    # one client's writes are the others' reads: the same keys through every client
    wire, tcp = clients["WireStore"], clients["TCPStore"]
    wire.append("shared", b"w")
    # an append has no reply (torch's protocol): a read on the same connection orders it
    # before the other client's append (the server serves each connection in order only)
    assert bytes(wire.get("shared")) == b"w"
    tcp.append("shared", b"t")
    assert bytes(tcp.get("shared")) == bytes(wire.get("shared")) == b"wt"
    wire.close()


def test_the_protocol_names_only_operations_both_clients_have() -> None:
    import torch.distributed as dist

    ops = {n for n, _ in inspect.getmembers(StoreLike, inspect.isfunction) if n[0] != "_"}
    assert ops == {
        "set",
        "get",
        "add",
        "compare_set",
        "check",
        "wait",
        "multi_get",
        "delete_key",
        "append",
        "clone",
    }
    for op in ops:
        assert callable(getattr(_wire.WireStore, op)) and callable(getattr(dist.TCPStore, op))
