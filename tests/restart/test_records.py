"""Round layouts and barrier records as read back from the store: run lists read without
expanding them, every record of a round in one parse."""

from __future__ import annotations

import json
import random

import pytest

from trainguard.errors import CoordinationError
from trainguard.restart._records import Ranks, layout, record, records, roster, runs


def _layout(active: list[int], spare: list[int]) -> bytes:
    doc = {
        "round": 3,
        "active": runs(active),
        "spare": runs(spare),
        "gone": {},
        "faults": {},
        "pg": "127.0.0.1:1234",
        "end": None,
    }
    return json.dumps(doc).encode()


@pytest.mark.parametrize("seed", range(20))
def test_a_layout_reads_back_as_the_ranks_it_was_made_of(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 300)
    ranks = [r for r in range(world) if rng.random() > 0.1]
    if seed % 3 == 0:
        rng.shuffle(ranks)  # a policy that reorders ranks
    cut = rng.randint(0, len(ranks))
    active, spare = ranks[:cut], ranks[cut:]

    ready = layout(_layout(active, spare))

    assert ready["active"] == active and active == ready["active"]
    assert ready["spare"] == spare and tuple(spare) == ready["spare"]
    assert list(ready["active"]) == active and len(ready["active"]) == len(active)
    for i, r in enumerate(active):
        assert ready["active"][i] == r and ready["active"].index(r) == i and r in ready["active"]
    assert ready["active"][-3:] == active[-3:] and ready["active"][::2] == active[::2]
    for r in set(range(world + 2)) - set(active):
        assert r not in ready["active"]
        with pytest.raises(ValueError):
            ready["active"].index(r)
    with pytest.raises(IndexError):
        ready["active"][len(active)]
    assert roster(ready["active"], ready["spare"]) == active + spare
    assert roster(active, spare) == tuple(active + spare)


def test_equal_ranks_compare_equal_however_they_were_cut_into_runs() -> None:
    assert Ranks([(0, 0), (1, 1), (2, 5)]) == Ranks([(0, 5)])
    assert Ranks([(0, 5)]) == list(range(6)) and Ranks([(0, 5)]) != list(range(5))
    assert Ranks([(0, 5)]) != Ranks([(0, 4), (6, 6)])
    assert hash(Ranks([(0, 2)])) == hash((0, 1, 2))
    assert "x" not in Ranks([(0, 2)]) and 1.5 not in Ranks([(0, 2)])


def test_a_huge_layout_is_read_without_expanding_it() -> None:
    # 2**21 ranks in order with one gone: reading it must not build a list of every rank
    world = 1 << 21
    ready = layout(_layout([r for r in range(world) if r != 1000], []))
    active = ready["active"]
    assert isinstance(active, Ranks) and len(active) == world - 1
    assert active.index(world - 1) == world - 2 and 1000 not in active and active[1000] == 1001


@pytest.mark.parametrize(
    "bad",
    [[[5, 2]], [[0, 1, 2]], [-1], ["3"], [True], [[0, 1 << 23]], "0-3", None],
)
def test_a_bad_rank_list_is_refused(bad: object) -> None:
    doc = json.loads(_layout([0, 1], []))
    doc["active"] = bad
    with pytest.raises(CoordinationError, match="bad active"):
        layout(json.dumps(doc))


def test_many_records_read_at_once_read_as_each_one_alone() -> None:
    """The last arriver parses every record in one go: the same records, and the same refusals
    (not JSON, a field missing, a value that would parse as two) as one parse each."""
    good = [
        json.dumps({"r": r, "host": "h", "local_rank": r % 8, "leave": None, "fault": None})
        for r in range(64)
    ]
    raws = [g.encode() for g in good]
    assert records(raws) == [record(raw) for raw in raws] != [None] * 64
    raws[3] = b"not json"
    raws[5] = b'{"r": 5}'
    raws[9] = b'{"r": true, "host": "h", "local_rank": 1, "leave": null, "fault": null}'
    got = records(raws)
    assert got == [record(raw) for raw in raws]
    assert [i for i, rec in enumerate(got) if rec is None] == [3, 5, 9]
    split = [raws[0] + b"," + raws[1], raws[2]]  # one value that is two: no shift
    assert records(split) == [None, record(raws[2])]
