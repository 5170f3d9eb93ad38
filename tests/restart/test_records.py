"""Round layouts and barrier records as read back from the store: run lists read without
expanding them, every record of a round in one parse."""

from __future__ import annotations

import json
import random

import pytest

from trainguard.errors import CoordinationError
from trainguard.restart._records import (
    BarrierRecord,
    Ranks,
    RoundLayout,
    layout,
    record,
    records,
    roster,
    runs,
)
from trainguard.restart._repeat import Repeats


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

    assert ready.active == active and active == ready.active
    assert ready.spare == spare and tuple(spare) == ready.spare
    assert list(ready.active) == active and len(ready.active) == len(active)
    for i, r in enumerate(active):
        assert ready.active[i] == r and ready.active.index(r) == i and r in ready.active
    assert ready.active[-3:] == active[-3:] and ready.active[::2] == active[::2]
    for r in set(range(world + 2)) - set(active):
        assert r not in ready.active
        with pytest.raises(ValueError):
            ready.active.index(r)
    with pytest.raises(IndexError):
        ready.active[len(active)]
    assert roster(ready.active, ready.spare) == active + spare
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
    active = ready.active
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


def test_typed_records_write_the_bytes_the_store_held_before() -> None:
    """The node watcher (no torch) and ranks of the same job read these bytes: the typed
    records write exactly the JSON that the dicts did, and read it back equal."""
    rec = BarrierRecord(3, "h", 1, progress=True)
    assert rec.encode() == (
        b'{"r":3,"host":"h","local_rank":1,"leave":null,"fault":null,"progress":true}'
    )
    gone = BarrierRecord.departure(2, "killed")
    assert gone.encode() == b'{"r":2,"host":"","local_rank":-1,"leave":"killed","fault":null}'
    assert record(rec.encode()) == rec and record(gone.encode()) == gone
    ready = RoundLayout(
        round=1,
        active=(0, 1, 2, 5),
        spare=(7,),
        gone={4: "died"},
        faults={4: "E"},
        pg="h:1",
        repeats=Repeats("E", 4, 1),
    )
    assert ready.encode() == (
        b'{"round":1,"active":[[0,2],5],"spare":[7],"gone":{"4":"died"},"faults":{"4":"E"},'
        b'"pg":"h:1","end":null,"repeats":{"cause":"E","rank":4,"count":1}}'
    )
    back = layout(ready.encode())
    assert back == ready and back.roster == [0, 1, 2, 5, 7] and back.holds(7)
    assert not back.holds(4)


_GOOD_LAYOUT = json.loads(_layout([0, 1], [2]))


def _with(**fields: object) -> bytes:
    return json.dumps({**_GOOD_LAYOUT, **fields}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,  # nesting deep enough to exhaust the parser's recursion
        b'{"a":' * 50_000,
        b"1" * 5000,  # an integer past Python's digit limit
        b"NaN",
        _with(gone={"\u00b2": "a superscript digit"}),
        _with(gone={"9" * 5000: "a rank of 5000 digits"}),
        _with(faults={"-1": "x"}),
        _with(round=True),
        _with(round=1.5),
        _with(pg=7),
        _with(end=["x"]),
        _with(active=[[0, 1 << 40]]),
        _with(spare={"0": 1}),
    ],
)
def test_garbage_never_decodes_and_never_crashes(raw: bytes) -> None:
    """Hostile or garbled bytes under a layout key are a CoordinationError naming the fix;
    under a record key they are no record. Nothing else is ever raised."""
    with pytest.raises(CoordinationError, match=r"unreadable round layout.*TRAINGUARD_JOB_SECRET"):
        RoundLayout.decode(raw)
    assert BarrierRecord.decode(raw) is None
    good = BarrierRecord(0, "h", 0).encode()
    assert records([raw, good]) == [None, BarrierRecord(0, "h", 0)]


@pytest.mark.parametrize(
    "doc",
    [
        {"r": True, "host": "h", "local_rank": 0},  # a JSON bool is not a rank
        {"r": -1, "host": "h", "local_rank": 0},
        {"r": 1.0, "host": "h", "local_rank": 0},
        {"r": 1, "host": 7, "local_rank": 0},
        {"r": 1, "host": "h", "local_rank": False},
        {"r": 1, "host": "h", "local_rank": "0"},
        {"r": 1, "host": "h", "local_rank": 0, "leave": 1},
        {"r": 1, "host": "h", "local_rank": 0, "fault": ["x"]},
        {"host": "h", "local_rank": 0},
        [1, "h", 0],
    ],
)
def test_a_record_of_the_wrong_types_is_none_alone_and_among_many(doc: object) -> None:
    """The last arriver reads every rank's record in one parse (:func:`records`): a record
    whose field has the wrong JSON type is no record there either."""
    raw = json.dumps(doc).encode()
    assert BarrierRecord.decode(raw) is None
    good = BarrierRecord(2, "h", 1, progress=True)
    assert records([good.encode(), raw]) == [good, None]


def test_a_records_optional_fields_are_kept_checked_and_cut() -> None:
    """``progress`` only as a bool, ``raised`` and ``probe`` only as text, of 2,000
    characters at most; ``leave`` and ``fault`` as given."""
    doc = {"r": 5, "host": "h", "local_rank": 3, "leave": "bye", "fault": "f", "progress": 1}
    doc.update(raised="x" * 5000, probe=7)
    (rec,) = records([json.dumps(doc).encode()])
    assert rec == BarrierRecord(5, "h", 3, leave="bye", fault="f", raised="x" * 2000)
    doc.update(progress=False, probe="ok", raised=None)
    assert records([json.dumps(doc).encode()]) == [
        BarrierRecord(5, "h", 3, leave="bye", fault="f", progress=False, probe="ok")
    ]
