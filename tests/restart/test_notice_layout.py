"""A death notice that completes a barrier lays the round out from the job's history: the
ranks gone before (a newcomer among them is admitted) and the run of repeated faults."""

from __future__ import annotations

import trainguard.restart as tr
from tests.restart.test_rejoin import _published_round_0


def test_a_notice_that_lays_out_the_round_admits_a_waiting_newcomer() -> None:
    from trainguard.restart import _records
    from trainguard.restart._book import RoundBook
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.sidecar._notice import write_notice

    store, keys, cfg = _published_round_0(tr.MaxActiveWorldSize(2))  # active 0, 1; spare 2
    write_notice(store, cfg, 1, 0, (0, 1, 2), "killed")  # rank 1 out; spare 2 takes its place
    policies = cfg.round_policies()
    books = {r: RoundBook(store, keys, 3, policies, store_timeout=5.0, writer=r) for r in (0, 2)}
    for n in (1, 2):
        store.set(keys.pg_addr(n), "127.0.0.1:1")
    for r, book in books.items():
        book.enter(_records.layout(store.get(keys.ready(0))))
        book.record(1, BarrierRecord(r, "h", r))
    assert books[0].arrive(1) is None and books[2].arrive(1) is not None
    one = _records.layout(store.get(keys.ready(1)))
    assert one.active == [0, 2] and 1 in one.gone
    # rank 1's respawn waits for round 2 with its record; rank 0 arrives; rank 2's node is
    # lost and the notice for it is the last arrival: it lays round 2 out
    newcomer = BarrierRecord(1, "h", 1)
    books[0].enter(one)
    books[0].record(2, newcomer)
    books[0].record(2, BarrierRecord(0, "h", 0))
    assert books[0].arrive(2) is None
    write_notice(store, cfg, 2, 1, (0, 2), "node lost")
    two = _records.layout(store.get(keys.ready(2)))
    assert two.end is None
    assert two.active == [0, 1]  # the newcomer took the free rank
    assert set(two.gone) == {2}  # gone now: rank 2 (rank 1 came back)
