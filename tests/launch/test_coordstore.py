"""The agents' coordination store: hosted by group rank 0, the generation, escalation."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tests._dist import free_port
from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError, CoordinationError
from trainguard.launch import escalate
from trainguard.launch._coordstore import CoordStore
from trainguard.launch._keys import escalate_key, generation_key


def rdzv_store():
    """A stand-in for one round's rendezvous store: a real TCPStore with a per-round prefix."""
    server = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, use_libuv=True
    )
    return server, lambda n: dist.PrefixStore(f"round{n}", server)


def test_agent0_hosts_the_store_and_the_others_find_it_with_the_generation() -> None:
    _server, round_store = rdzv_store()
    a0 = CoordStore(external=None, timeout=10)
    a1 = CoordStore(external=None, timeout=10)
    common = {"run_id": "job", "advertise": "127.0.0.1", "bind": "127.0.0.1"}
    g0 = a0.join(round_store(0), group_rank=0, **common)
    g1 = a1.join(round_store(0), group_rank=1, **common)
    assert g0 == g1 and g0.generation == 0
    host, port = parse_addr(g0.addr)
    assert host == "127.0.0.1" and port == a0.server.port
    # a second round: same store (the agent's lifetime), next generation
    assert a0.join(round_store(1), group_rank=0, **common).generation == 1
    assert a1.join(round_store(1), group_rank=1, **common).generation == 1
    assert a1.client.add(generation_key("job"), 0) == 2
    a0.close()
    a1.close()


def test_a_new_host_continues_the_generation_it_saw() -> None:
    _server, round_store = rdzv_store()
    common = {"run_id": "job", "advertise": "127.0.0.1", "bind": "127.0.0.1"}
    a0, a1 = CoordStore(external=None, timeout=10), CoordStore(external=None, timeout=10)
    for n in range(3):
        a0.join(round_store(n), group_rank=0, **common)
        a1.join(round_store(n), group_rank=1, **common)
    assert a1.last_generation == 2
    a0.close()  # agent 0 gone; agent 1 becomes group rank 0 and hosts a fresh store
    assert a1.join(round_store(3), group_rank=0, **common).generation == 3
    a1.close()


def test_an_external_store_keeps_counting_across_jobs() -> None:
    port = free_port()
    external = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    external.add(generation_key("job"), 5)  # an earlier job with this run id had 5
    _server, round_store = rdzv_store()
    a0 = CoordStore(external=("127.0.0.1", port), timeout=10)
    joined = a0.join(round_store(0), group_rank=0, run_id="job", advertise="x", bind="127.0.0.1")
    assert joined.generation == 5 and joined.addr == f"127.0.0.1:{port}"
    assert a0.server is None  # nothing hosted


def test_escalation_first_reason_wins_and_is_per_generation() -> None:
    _server, round_store = rdzv_store()
    a0 = CoordStore(external=None, timeout=10)
    a0.join(round_store(0), group_rank=0, run_id="job", advertise="127.0.0.1", bind="127.0.0.1")
    assert a0.escalation("job", 0) is None
    a0.escalate("job", 0, "first")
    a0.escalate("job", 0, "second")
    assert a0.escalation("job", 0) == "first"
    assert a0.escalation("job", 1) is None


def test_worker_escalate_sets_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    _server, round_store = rdzv_store()
    a0 = CoordStore(external=None, timeout=10)
    joined = a0.join(
        round_store(0), group_rank=0, run_id="job", advertise="127.0.0.1", bind="127.0.0.1"
    )
    monkeypatch.setenv("TRAINGUARD_STORE_ADDR", joined.addr)
    monkeypatch.setenv("TRAINGUARD_GENERATION", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    escalate("optimizer state is gone", timeout=10)
    assert a0.escalation("job", 0) == "optimizer state is gone"
    assert a0.client.get(escalate_key("job", 0)) == b"optimizer state is gone"


def test_worker_escalate_outside_the_launcher_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRAINGUARD_GENERATION", raising=False)
    with pytest.raises(ConfigError, match="trainguard launch"):
        escalate("x")


def test_a_missing_publication_is_a_coordination_error() -> None:
    server = dist.TCPStore(
        "127.0.0.1",
        free_port(),
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=0.5),
    )
    a1 = CoordStore(external=None, timeout=1)
    with pytest.raises(CoordinationError, match="did not publish"):
        a1.join(server, group_rank=1, run_id="job", advertise="127.0.0.1", bind="127.0.0.1")
