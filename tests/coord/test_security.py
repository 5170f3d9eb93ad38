"""Stores the library starts listen on MASTER_ADDR's interface only; store addresses and the
job secret variable are checked; values read back from the store are checked."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.coord import _helpers
from trainguard.coord import Keyspace, _bind, connect
from trainguard.errors import ConfigError, CoordinationError


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not a loopback address (from the kernel's
    table of local addresses), or None."""
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return None
    for previous, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line:
            address = previous.split()[-1]
            if not address.startswith("127."):
                return address
    return None


def _reachable(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def test_stores_bound_to_loopback_are_not_reachable_on_other_interfaces() -> None:
    outside = _non_loopback_ipv4()
    if outside is None:
        pytest.skip("this machine has no non-loopback address")
    port = free_port()
    server = _helpers.store_process("sec", port).start()
    client = connect("127.0.0.1", port, timeout=30)
    keys = Keyspace("sec")
    try:
        round_ports = [int(bytes(client.get(keys.pg_addr(n))).rsplit(b":", 1)[1]) for n in (0, 1)]
        for p in (port, *round_ports):
            assert _reachable("127.0.0.1", p), p
            assert not _reachable(outside, p), f"port {p} answers on {outside}"
    finally:
        client.set(keys.exit, b"test over")
        server.close(timeout=10)


def test_a_host_name_of_no_address_here_binds_all_interfaces_with_a_warning(caplog) -> None:
    # rank 0 does not host MASTER_ADDR and its own name resolves to loopback only ("localhost"
    # stands for a name that /etc/hosts maps to 127.0.1.1): the round stores listen on every
    # interface, and the user is told how to avoid it
    with caplog.at_level("INFO", logger="trainguard.coord._bind"):
        assert _bind.bind_host("localhost", local=False) == ""
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert "listen on every interface" in record.message
    assert "set MASTER_ADDR to an address of this machine" in record.message


@pytest.mark.parametrize("value", ["h:99999", "h:0", "h:", ":29500", "h:x", "h", "h:\uff12\uff19"])
def test_store_addresses_out_of_range_are_refused_when_the_wrapper_is_built(value: str) -> None:
    import trainguard.restart as tr

    with pytest.raises(ConfigError, match="host:port"):
        tr.Wrapper(store=value)


def test_checkpointers_refuse_an_address_as_store(tmp_path) -> None:
    from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager

    with pytest.raises(ConfigError, match=r"1\.\.65535"):
        AsyncCheckpointer(store="h:99999", rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not an address"):
        LocalCheckpointManager(tmp_path / "l", store="h:29500")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["short", "x" * 15, "a/" * 10, "é" * 20])
def test_bad_job_secret_variable_names_the_fix(value: str) -> None:
    from trainguard import _env

    with pytest.raises(ConfigError, match="openssl rand"):
        _env.settings({"TRAINGUARD_JOB_SECRET": value})


def test_keys_hold_the_secret_and_never_show_it() -> None:
    keys = Keyspace("job", 1, "s" * 32)
    assert keys.ready(0).startswith(f"tg/job/1/{'s' * 32}/")
    assert keys.node_heartbeat(3).startswith(keys.prefix)
    assert not keys.handover.startswith(keys.prefix)
    assert "s" * 32 not in repr(keys)


@pytest.mark.parametrize(
    "raw",
    [
        b"garbage",
        b"[]",
        b'{"round": 0}',
        b'{"round":0,"active":["x"],"spare":[],"gone":{},"faults":{},"pg":"","end":null}',
        b'{"round":0,"active":[0],"spare":[],"gone":{"a":1},"faults":{},"pg":"","end":null}',
        b'{"round":0,"active":[0],"spare":[],"gone":{},"faults":{},"pg":"h:99999","end":null}',
    ],
)
def test_an_unreadable_round_layout_is_a_clear_error(raw: bytes) -> None:
    from trainguard.restart import _records

    with pytest.raises(CoordinationError, match="unreadable round layout"):
        _records.layout(raw)
    assert _records.record(raw) is None
