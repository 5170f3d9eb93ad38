"""No stalls on the restart's critical path: the next round's store is connected ahead of time,
and a rank blocked in a collective is aborted without waiting for it to leave."""

from __future__ import annotations

from tests._dist import run_ranks
from tests.restart import _fast


def test_blocked_rank_is_aborted_at_once_and_next_store_is_connected_ahead() -> None:
    results = run_ranks(_fast.blocked_rank_job, 4, timeout=240)
    values = [r.get() for r in results]
    fault = values[0]["fault"]
    assert fault is not None and all(v["rounds"] == 1 for v in values)
    # ranks 1-3 waited in collectives: their aborts did not wait settle_s for them to leave
    reentry = max(v["enter"][1] for v in values) - fault
    assert 0 < reentry < _fast.SETTLE_S / 2, f"every rank back after {reentry:.2f} s"
    for v in values:
        # round 0's store is reached by init_process_group; round 1's was connected during
        # round 0, and init_process_group took that connection instead of making another
        assert v["before_init"] == {0: 0, 1: 1}, v["before_init"]
        assert v["after_init"] == {0: 1, 1: 1}, v["after_init"]
        # nothing left behind: no pre-connect thread, no store connection
        assert v["after"]["threads"] == v["before"]["threads"]
        assert v["after"]["sockets"] == v["before"]["sockets"]
