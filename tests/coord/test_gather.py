"""coord.gather against a real TCPStore, participants as threads."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.coord import _helpers
from trainguard.coord import gather
from trainguard.errors import CoordinationError

N = 3


def test_gather_returns_every_value_everywhere_and_cleans_up(store) -> None:
    def participant(r: int) -> dict[int, Any]:
        time.sleep(0.02 * r)
        return gather(
            store.clone(), "g", {"r": r, "parts": [r, [1, 2]]}, rank=r, world_size=N, timeout=10
        )

    results = _helpers.in_threads(participant, N)
    expected = {r: {"r": r, "parts": [r, [1, 2]]} for r in range(N)}
    assert all(v == expected for v in results.values())
    assert not store.check([f"g/{r}" for r in range(N)] + ["g/seen"])


def test_gather_names_the_ranks_that_never_report(store) -> None:
    with pytest.raises(CoordinationError, match=r"what they hold within 0\.2 s; call") as err:
        gather(
            store,
            "h",
            [],
            rank=1,
            world_size=3,
            timeout=0.2,
            what="what they hold",
            hint="call it on every rank",
        )
    assert sorted(err.value.causes) == [0, 2]


def test_gather_names_a_rank_whose_value_is_garbage(store) -> None:
    store.set("k/0", b"\xff not json")
    with pytest.raises(CoordinationError, match=r"rank 0's value of .* unreadable") as err:
        gather(store, "k", {"ok": 1}, rank=1, world_size=2, timeout=10, what="parts")
    assert list(err.value.causes) == [0]
