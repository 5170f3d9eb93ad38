"""Judging a node ring (:func:`trainguard.coord.ring_judge.judge`): data in, verdicts out.

No store and no clock: the readings, the clocks and the time are passed as data, as
``live/_plan.py``'s plans are tested. The rings of the agents and of the node watchers that act
on these verdicts are tested against a real store in ``tests/launch/test_heartbeat.py`` and
``tests/restart/test_node_liveness.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.coord.liveness import BYE, clock_after
from trainguard.coord.ring_judge import (
    LOST,
    MAX_MEMBERS,
    NO_BEAT,
    judge,
    node_value,
    parse_value,
    unbeaten,
)

TIMEOUT = 3.0


def beat(members: tuple[int, ...], counter: int, instance: bytes = b"abc") -> bytes:
    return node_value(members, instance, counter)


def test_a_value_is_members_instance_counter() -> None:
    assert beat((8, 9, 10), 42) == b"8,9,10/abc/42"
    assert parse_value(beat((8, 9, 10), 42)) == ([8, 9, 10], 42)
    assert parse_value(beat((), 1)) == ([], 1)
    assert parse_value(unbeaten(5)) == ([5], 0)  # judged like a beat that never moves


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        NO_BEAT,
        BYE,
        LOST + b"0/abc",
        b"8,9/42",  # no instance
        b"8,x/abc/42",
        b"8/abc/4x",
        b"8/abc/" + b"9" * 21,  # a counter of more than 20 digits
        b"1234567890/abc/1",  # a member of more than 9 digits
        b",".join(b"1" for _ in range(MAX_MEMBERS + 1)) + b"/abc/1",
        b"8/a/b/1",
    ],
)
def test_what_is_no_beat(raw: bytes) -> None:
    assert parse_value(raw) is None


def test_a_member_seen_first_starts_its_clock_and_is_silent_once_unchanged_for_timeout() -> None:
    first = judge([(4, beat((4, 5), 1))], {}, 100.0, timeout=TIMEOUT)
    assert [(v.state, v.silent, v.late) for v in first.verdicts] == [("beat", 0.0, False)]
    assert first.clocks == {4: (beat((4, 5), 1), 100.0)}
    later = judge([(4, beat((4, 5), 1))], first.clocks, 102.9, timeout=TIMEOUT)
    assert later.silent == [] and later.verdicts[0].silent == pytest.approx(2.9)
    late = judge([(4, beat((4, 5), 1))], first.clocks, 103.0, timeout=TIMEOUT)
    assert late.silent == [4]
    assert late.verdicts[0].members == (4, 5)  # whom its node counts out with it


def test_a_beat_that_moved_restarts_its_clock() -> None:
    clocks = {4: (beat((4,), 1), 100.0)}
    j = judge([(4, beat((4,), 2))], clocks, 150.0, timeout=TIMEOUT)
    assert j.silent == [] and j.clocks == {4: (beat((4,), 2), 150.0)}
    # any change of the raw value counts: another instance beating the same counter too
    j = judge([(4, beat((4,), 1, b"new"))], clocks, 150.0, timeout=TIMEOUT)
    assert j.silent == []


def test_ended_lost_and_quiet_members_have_no_clock_and_are_never_silent() -> None:
    readings = [(1, BYE), (2, LOST + b"0/abc"), (3, NO_BEAT), (4, b"garbage"), (5, b"")]
    clocks = {m: (b"old", 0.0) for m in range(1, 6)}
    j = judge(readings, clocks, 1000.0, timeout=TIMEOUT)
    assert [v.state for v in j.verdicts] == ["ended", "lost", "quiet", "quiet", "quiet"]
    assert j.silent == [] and j.clocks == {}


def test_a_gone_member_stays_gone_until_its_value_changes_to_a_beat() -> None:
    went = beat((4,), 7)
    gone = {4: went, 6: LOST + b"0/abc", 7: None}
    readings = [(4, went), (6, LOST + b"0/abc"), (7, NO_BEAT)]
    j = judge(readings, {}, 100.0, timeout=TIMEOUT, gone=gone)
    assert [v.state for v in j.verdicts] == ["gone", "gone", "quiet"]
    assert not any(v.back for v in j.verdicts) and j.clocks == {}
    # a replacement beats in 6's place, 4 moves again, 7 (counted out with its node) leads now
    readings = [(4, beat((4,), 8)), (6, beat((6,), 1, b"new")), (7, beat((7,), 1))]
    clocks = {4: (went, 0.0)}  # a stale clock is not used for a member that is back
    j = judge(readings, clocks, 100.0, timeout=TIMEOUT, gone=gone)
    assert [(v.state, v.back, v.silent) for v in j.verdicts] == [("beat", True, 0.0)] * 3
    assert j.silent == []


def test_the_verdicts_are_in_ring_order_and_the_clocks_given_are_not_changed() -> None:
    clocks = {9: (beat((9,), 1), 0.0), 2: (beat((2,), 5), 0.0)}
    before = dict(clocks)
    readings = [(9, beat((9,), 1)), (0, BYE), (2, beat((2,), 5))]
    j = judge(readings, clocks, 10.0, timeout=TIMEOUT)
    assert [v.member for v in j.verdicts] == [9, 0, 2]
    assert j.silent == [9, 2]
    assert clocks == before  # a pure function: the new clocks are its result
    assert j.clocks == before


def test_the_clock_rule_is_the_rank_rings_too() -> None:
    assert clock_after(None, b"a", 5.0) == ((b"a", 5.0), 0.0)
    assert clock_after((b"a", 5.0), b"a", 7.5) == ((b"a", 5.0), 2.5)
    assert clock_after((b"a", 5.0), b"b", 7.5) == ((b"b", 7.5), 0.0)


# the ring acting on the verdicts, on a store of a dict (the real store's tests are elsewhere) ---
class DictStore:
    """``set``, ``compare_set`` and ``multi_get`` as a TCPStore does them, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.reads: list[list[str]] = []

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else expected
        desired = desired.encode() if isinstance(desired, str) else desired
        if self.data.get(key, b"") == expected:
            self.data[key] = desired
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads.append(list(keys))
        return [self.data[k] for k in keys]


def _rings(store: DictStore, nodes: dict[str, tuple[int, ...]], now: list[float], **kw: Any):
    from trainguard.coord.node_ring import NodeRing

    roster = tuple(sorted(r for ranks in nodes.values() for r in ranks))
    return {
        name: NodeRing(
            store,
            lambda leader: f"n/{leader}",
            position=lambda name=name: (nodes[name], 0, roster),
            interval=1.0,
            timeout=TIMEOUT,
            window=kw.get("window", 32),
            clock=lambda: now[0],
            **{k: v for k, v in kw.items() if k != "window"},
        )
        for name in nodes
    }


def _tick(rings: dict[str, Any], now: list[float], names: str) -> None:
    for name in names:
        rings[name].beat_and_look()
    now[0] += 1.0


def test_without_marks_a_node_counted_out_that_beats_again_is_judged_afresh() -> None:
    store, now, silent = DictStore(), [0.0], []
    nodes = {"a": (0, 1), "b": (2, 3), "c": (4, 5)}
    rings = _rings(store, nodes, now, on_silent=lambda m, ranks, *_: silent.append((m, ranks)))
    for _ in range(2):
        _tick(rings, now, "abc")
    for _ in range(4):  # b stops (SIGSTOP): a and c both count it out, each once
        _tick(rings, now, "ac")
    assert silent == [(2, [2, 3]), (2, [2, 3])]
    assert store.data["n/2"].startswith(b"2,3/")  # no mark: its last beat stays
    for _ in range(2):  # b goes on (SIGCONT): seen back (a reads after c), judged afresh
        _tick(rings, now, "abc")
    assert 2 not in rings["a"].gone and 2 not in rings["c"].gone
    assert rings["a"].seen[2][1] == now[0] - 1.0  # its clock started at the last read
    for _ in range(4):
        _tick(rings, now, "abc")
    assert len(silent) == 2  # not counted out again while it beats


def test_with_marks_the_node_before_a_silent_one_declares_it_and_the_slow_one_is_evicted() -> None:
    store, now, lost, evicted = DictStore(), [0.0], [], []
    nodes = {"a": (0,), "b": (1,), "c": (2,)}
    rings = _rings(
        store,
        nodes,
        now,
        window=2,
        blank=unbeaten,
        on_lost=lost.append,
        on_evicted=lambda: evicted.append(1),
    )
    assert store.data == {}
    _tick(rings, now, "a")  # b and c never beat yet: their keys hold a beat of counter 0
    assert parse_value(store.data["n/1"]) == ([1], 0)
    for _ in range(4):
        _tick(rings, now, "ac")  # b never beats: judged as one that stopped
    assert lost == [1] and rings["a"].declared == [1] and rings["c"].declared == []
    assert store.data["n/1"].startswith(LOST + b"0/")
    rings["b"].beat_and_look()  # a first beat (a late start, a replacement) overwrites it...
    assert rings["b"].beat_and_look() is True and not rings["b"].evicted
    store.data["n/1"] = LOST + b"0/other"  # ...a later mark is found by its guarded beat
    assert rings["b"].beat_and_look() is False and rings["b"].evicted and evicted == [1]
    rings["b"].close()
    assert store.data["n/1"] == LOST + b"0/other"  # an evicted node says no bye
    rings["a"].close()
    assert store.data["n/0"] == BYE


def test_a_read_goes_on_until_the_window_is_full_of_members_not_gone() -> None:
    store, now = DictStore(), [0.0]
    nodes = {name: (i,) for i, name in enumerate("abcdef")}
    rings = _rings(store, nodes, now, window=2, blank=unbeaten, on_lost=lambda _: None)
    for _ in range(2):
        _tick(rings, now, "abcdef")
    store.set("n/1", BYE)
    store.set("n/2", BYE)
    store.reads.clear()
    rings["a"].beat_and_look()
    assert store.reads == [["n/1", "n/2"], ["n/3", "n/4"]]  # the same interval
    assert rings["a"].target == 3
    store.reads.clear()
    rings["a"].beat_and_look()  # the gone ones are read still: a replacement is seen
    assert store.reads == [["n/1", "n/2", "n/3", "n/4"]]
