"""The round book's pool: a round's records
appended to one key; a departure wins over an arrival in either order; the last add lays the
round out from one read; a notice learns whether its rank had arrived first; a newcomer's
uncounted record is admitted. In one process against a real TCPStore."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import trainguard.restart as tr
from tests.restart import _faults
from trainguard.coord.keys import Keyspace
from trainguard.restart import _records
from trainguard.restart._book import RoundBook
from trainguard.restart._pool import records_of as pool_records
from trainguard.restart._records import BarrierRecord


def _job(world: int = 3) -> tuple[Any, Keyspace, Any, Any]:
    from trainguard.restart.sidecar import SidecarConfig

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    keys = Keyspace("pool", 0, "s3cret-pool")
    wcfg = tr.WrapperConfig(**{**_faults.TIMEOUTS, "store_timeout": 5.0})
    cfg = SidecarConfig.build(
        wcfg, rank=0, world=world, keys=keys, addr=("127.0.0.1", store.port), log_dir=None
    )
    for n in range(4):
        store.set(keys.pg_addr(n), "127.0.0.1:1")
    return store, keys, wcfg, cfg


def _book(store: Any, keys: Keyspace, wcfg: Any, world: int = 3, **kw: Any) -> RoundBook:
    return RoundBook(store, keys, world, wcfg.policies, store_timeout=5.0, **kw)


def test_a_departure_wins_over_an_arrival_in_either_order() -> None:
    leave = BarrierRecord.departure(1, "gone").encode()
    come = BarrierRecord(1, "h", 1).encode()
    for lines in ([come, leave], [leave, come], [come, come, leave, come]):
        found = pool_records(b"\n".join(lines) + b"\n")
        assert found[1] is not None and found[1].leave == "gone"
    assert pool_records(b"not json\n" + come + b"\n")[1] == BarrierRecord(1, "h", 1)


def test_a_node_arrives_for_its_ranks_with_one_append_and_one_add() -> None:
    store, keys, wcfg, _ = _job()
    node = _book(store, keys, wcfg)
    node.pool(0, [BarrierRecord(r, "h", r).encode() for r in (0, 1)])
    assert node.arrive(0, 2) is None  # rank 2 has not arrived
    last = _book(store, keys, wcfg, writer=2)
    last.record(0, BarrierRecord(2, "h", 2))
    raw = last.arrive(0)
    assert raw is not None
    assert _records.layout(raw).active == [0, 1, 2]
    # round 1: the pool of round 0 goes with the round
    last.enter(_records.layout(raw))
    node.enter(_records.layout(raw))
    node.pool(1, [BarrierRecord(r, "h", r).encode() for r in range(3)])
    assert node.arrive(1, 3) is not None
    assert not store.check([keys.pool(0)])


def test_a_notice_learns_whether_its_rank_had_arrived_and_its_departure_holds() -> None:
    from trainguard.restart.sidecar._notice import write_notice

    store, keys, wcfg, cfg = _job()
    first = _book(store, keys, wcfg)
    first.pool(0, [BarrierRecord(r, "h", r).encode() for r in range(3)])
    ready0 = _records.layout(first.arrive(0, 3) or b"")
    # rank 2 dies before its node arrives for it at round 1: its departure comes first, the
    # node's arrival for it later does not bring it back
    done = write_notice(store, cfg, 2, 0, tuple(ready0.roster), "killed")
    assert done.counted and done.gone_round == 0
    node = _book(store, keys, wcfg)
    node.enter(ready0)
    node.pool(1, [BarrierRecord(r, "h", r).encode() for r in range(3)])
    one = _records.layout(node.arrive(1, 3) or b"")
    assert one.active == [0, 1] and 2 in one.gone
    # rank 1 dies after its node arrived for it at round 2, which was published with it: the
    # notice learns that it had arrived first (it then follows it into round 2)
    node.enter(one)
    node.pool(2, [BarrierRecord(0, "h", 0).encode(), BarrierRecord(1, "h", 1).encode()])
    two = _records.layout(node.arrive(2, 2) or b"")
    assert two.active == [0, 1]
    assert node.take_arrival(2, 1, "killed") is True
    # no arrival before its departure: False (the notice counts it out and is done)
    node.enter(two)
    assert node.take_arrival(3, 1, "killed") is False
    node.pool(3, [BarrierRecord(0, "h", 0).encode(), BarrierRecord(1, "h", 1).encode()])
    three = _records.layout(node.arrive(3, 2) or b"")
    assert three.active == [0] and set(three.gone) == {1, 2}


def test_a_newcomer_s_uncounted_record_in_the_pool_is_admitted() -> None:
    store, keys, wcfg, cfg = _job()
    from trainguard.restart.sidecar._notice import write_notice

    node = _book(store, keys, wcfg)
    node.pool(0, [BarrierRecord(r, "h", r).encode() for r in range(3)])
    ready0 = _records.layout(node.arrive(0, 3) or b"")
    write_notice(store, cfg, 1, 0, tuple(ready0.roster), "killed")
    node.enter(ready0)
    node.pool(1, [BarrierRecord(0, "h", 0).encode(), BarrierRecord(2, "h", 2).encode()])
    one = _records.layout(node.arrive(1, 2) or b"")
    assert one.active == [0, 2]
    newcomer = _book(store, keys, wcfg, writer=1)
    newcomer.enter(one)
    newcomer.record(2, BarrierRecord(1, "h", 1))  # uncounted
    node.enter(one)
    node.pool(2, [BarrierRecord(0, "h", 0).encode(), BarrierRecord(2, "h", 2).encode()])
    two = _records.layout(node.arrive(2, 2) or b"")
    assert 1 not in two.gone and sorted(two.roster) == [0, 1, 2]
