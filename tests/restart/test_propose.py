"""A round's outcome has one writer (``RoundBook.propose`` / ``complete``) over a real TCPStore:
of racing proposals exactly one wins, and what the store holds is the winner's outcome."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from trainguard.coord.keys import Keyspace
from trainguard.restart._book import RoundBook, peek
from trainguard.restart.policy._round import RoundPolicies
from trainguard.restart.state import RoundOutcome

ROUNDS = 40


@pytest.fixture()
def store() -> Any:
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    yield server
    del server


def _book(store: Any, writer: int) -> RoundBook:
    return RoundBook(
        store, Keyspace("prop", 0, "s3cret"), 2, RoundPolicies(), store_timeout=5.0, writer=writer
    )


def _clone(store: Any) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, is_master=False)


def test_of_two_racing_proposals_exactly_one_wins(store: Any) -> None:
    """Two writers, each on its own connection, released together for each of ROUNDS
    rounds: one fault per writer. Exactly one proposal of each round wins, and the stop key
    holds the winner's outcome (a later proposal never overwrites it)."""
    books = [_book(_clone(store), r) for r in (0, 1)]
    start = threading.Barrier(2)
    won: dict[int, list[int]] = {n: [] for n in range(ROUNDS)}
    lock = threading.Lock()

    def race(r: int) -> None:
        for n in range(ROUNDS):
            start.wait(10)
            if books[r].propose(n, RoundOutcome.fault(r, f"rank {r} failed", "RuntimeError")):
                with lock:
                    won[n].append(r)

    threads = [threading.Thread(target=race, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    keys = books[0].keys
    for n, winners in won.items():
        assert len(winners) == 1, f"round {n}: winners {winners}"
        raw = peek(store, keys.stop(n))
        assert raw is not None
        held = RoundOutcome.decode(raw)
        assert (held.why, held.rank) == ("fault", winners[0])
        # the loser, proposing again with another outcome, still loses
        assert not books[1 - winners[0]].propose(n, RoundOutcome.end("late"))
        assert peek(store, keys.stop(n)) == raw


def test_the_last_returning_rank_completes_the_round_unless_a_fault_came_first(
    store: Any,
) -> None:
    book = _book(store, 0)
    keys = book.keys
    assert not book.complete(0, 3) and not book.complete(0, 3)
    assert peek(store, keys.stop(0)) is None  # two of three returned: no outcome yet
    assert book.complete(0, 3)
    raw = peek(store, keys.stop(0))
    assert raw is not None and RoundOutcome.decode(raw).why == "complete"
    # round 1: a fault is proposed before the last rank returns; the fault holds
    assert book.propose(1, RoundOutcome.fault(1, "boom", "RuntimeError"))
    assert not book.complete(1, 1)
    raw = peek(store, keys.stop(1))
    assert raw is not None and RoundOutcome.decode(raw).why == "fault"
