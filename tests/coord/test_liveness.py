"""RingWatch, the one liveness ring: a fake clock (the only fake) against a real TCPStore.

Each test builds a ring of members on one store client (the looks run one after another on
this thread) and moves the clock itself; the last test drives the real scheduler.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest

from trainguard.coord.liveness import RingWatch, read_counter, ring_after

INTERVAL = 1.0
TIMEOUT = 3.0
TIMEOUT_TICKS = int(TIMEOUT / INTERVAL) + 1  # from a member's last beat until it is judged


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ring:
    """``n`` members on one fake clock; :meth:`tick` moves it one interval and lets every
    running member beat and look, in member order."""

    def __init__(self, store: Any, n: int, window: int) -> None:
        self.clock = FakeClock()
        self.prefix = f"ring-{uuid.uuid4().hex[:8]}/"  # this test's own keys
        self.silent: list[tuple[int, int, float, float]] = []  # (watcher, member, secs, when)
        self.epoch = 0
        self.members = tuple(range(n))
        self.watches = [self.make(store, m, window) for m in range(n)]
        self.running = set(self.members)

    def key(self, m: int) -> str:
        return f"{self.prefix}hb/{m}"

    def make(self, store: Any, me: int, window: int) -> RingWatch:
        def on_silent(m: int, secs: float, epoch: int, members: tuple[int, ...]) -> None:
            assert (epoch, members) == (self.epoch, self.members)
            self.silent.append((me, m, secs, self.clock.now))

        return RingWatch(
            store,
            self.key,
            me=me,
            interval=INTERVAL,
            timeout=TIMEOUT,
            window=window,
            name="rank",
            members=lambda: (self.epoch, self.members),
            on_silent=on_silent,
            clock=self.clock,
        )

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.clock.now += INTERVAL
            for m in sorted(self.running):
                self.watches[m].beat()
                self.watches[m].look()


def test_a_member_that_stops_beating_is_judged_silent_after_the_timeout(store: Any) -> None:
    ring = Ring(store, 4, window=2)  # 0 and 1 observe 2
    ring.tick(5)  # 2's last beat at t0+5, after 0 and 1 looked: they read it at t0+6
    ring.running.discard(2)
    ring.tick(3)  # t0+8: 2 s since they saw it move
    assert ring.silent == []
    ring.tick()  # t0+9: TIMEOUT since they saw it move
    when = ring.clock.now
    assert sorted(ring.silent) == [(0, 2, TIMEOUT, when), (1, 2, TIMEOUT, when)]
    assert 2 in ring.watches[0].gone and 2 in ring.watches[1].gone
    assert 2 not in ring.watches[0].seen  # its clock dropped: never judged twice
    ring.tick(5)
    assert len(ring.silent) == 2
    # the window moved on past it: 1 now observes 3 and 0
    assert ring.watches[1].observed(ring.epoch, ring.members) == [3, 0]


def test_a_paused_watcher_restarts_its_clocks_instead_of_judging(store: Any) -> None:
    ring = Ring(store, 3, window=2)
    ring.tick(3)
    # the whole machine stops for 10 s (a suspended VM): nobody beats, no clock is looked at
    ring.clock.now += 10.0
    ring.tick()  # the first look after it: every clock starts afresh, nobody is judged
    assert ring.silent == []
    ring.tick(10)  # everyone beats again: nobody is ever judged
    assert ring.silent == []
    # the clocks restarted, they were not switched off: a member that stays silent after the
    # pause is still judged, TIMEOUT after the restart
    ring.clock.now += 10.0
    ring.running.discard(1)
    ring.tick()  # restart (1's value as of the pause)
    ring.tick(2)
    assert ring.silent == []
    ring.tick()
    assert sorted((w, m, s) for w, m, s, _ in ring.silent) == [(0, 1, TIMEOUT), (2, 1, TIMEOUT)]


def test_a_gap_under_the_quiet_limit_counts_toward_silence(store: Any) -> None:
    # the contrast to the paused watcher: a look 1.5 s after the previous one (under
    # max(TIMEOUT / 2, 2 * INTERVAL) = 2 s) restarts no clock
    ring = Ring(store, 3, window=2)  # 2 observes 0 and 1
    ring.tick(3)  # 2 saw 1's last beat at t0+3
    ring.running.discard(1)
    ring.tick()
    ring.clock.now += 0.5
    ring.tick()  # t0+5.5
    assert ring.silent == []
    ring.tick()  # t0+6.5: 3.5 s since 2 saw 1 move (a restart would have made it 1 s)
    assert [(w, m, s) for w, m, s, _ in ring.silent] == [(2, 1, 3.5)]


def test_the_window_wraps_around_and_reads_window_keys_in_one_multi_get(store: Any) -> None:
    assert ring_after(4, range(6)) == [5, 0, 1, 2, 3]
    assert ring_after(2, [7, 2, 0, 9]) == [7, 9, 0]
    assert ring_after(9, [7, 2, 0, 9]) == [0, 2, 7]
    ring = Ring(store, 6, window=3)
    assert ring.watches[4].observed(0, ring.members) == [5, 0, 1]
    assert ring.watches[5].observed(0, ring.members) == [0, 1, 2]
    reads: list[list[str]] = []
    counting = Counting(store, reads)
    ring.watches[4].store = counting
    ring.tick(2)
    assert reads == [[ring.key(5), ring.key(0), ring.key(1)]] * 2
    ring.running.discard(0)  # 0 is observed by 3, 4 and 5: across the wrap for 4 and 5
    ring.tick(TIMEOUT_TICKS)
    assert sorted((w, m) for w, m, _, _ in ring.silent) == [(3, 0), (4, 0), (5, 0)]
    assert ring.watches[4].observed(0, ring.members) == [5, 1, 2]  # past the gone member
    # a new epoch (round) with fewer members: the window is taken afresh
    ring.epoch, ring.members = 1, (1, 3, 4)
    assert ring.watches[4].observed(1, ring.members) == [1, 3]


class Counting:
    """A real store, the keys of each ``multi_get`` recorded."""

    def __init__(self, store: Any, reads: list[list[str]]) -> None:
        self.store, self.reads = store, reads

    def multi_get(self, keys: list[str]) -> Any:
        self.reads.append(list(keys))
        return self.store.multi_get(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_bye_blank_and_garbage(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    ring = Ring(store, 4, window=3)  # 0 observes 1, 2, 3
    store.set(ring.key(1), b"bye")  # ended normally
    store.set(ring.key(3), b"\xffnot a counter")
    ring.running = {0}  # 2 never beats: its key stays "0"
    with caplog.at_level(logging.WARNING, logger="trainguard.coord.liveness"):
        ring.tick(TIMEOUT_TICKS + 3)
    assert [(m, s) for _, m, s, _ in ring.silent] == [(3, TIMEOUT)]  # garbage does not move
    assert ring.watches[0].gone == {1, 3}  # bye: gone, never reported
    assert 2 not in ring.watches[0].seen  # never beat: never judged
    warnings = [r.getMessage() for r in caplog.records if "no counter" in r.getMessage()]
    assert warnings == ["rank 3's heartbeat in the store is no counter (14 bytes: "
                        "b'\\xffnot a counter'): judged as silent unless it moves"]  # fmt: skip
    assert read_counter(b"") == 0 and read_counter(b"12") == 12
    assert read_counter(b"7" * 21) == -1 and read_counter(b"-3") == -1


def test_guarded_beats_find_a_mark_written_over_them(store: Any) -> None:
    key = f"ring-{uuid.uuid4().hex[:8]}/node/0"
    ring = RingWatch(
        store, lambda m: key, me=0, interval=INTERVAL, timeout=TIMEOUT, window=2,
        blank=b"", prefix=b"inst/", guarded=True, clock=FakeClock(),
    )  # fmt: skip
    store.set(key, b"lost/1/other")  # a replacement's first beat overwrites a lost mark
    assert ring.beat() is None and bytes(store.get(key)) == b"inst/1"
    store.set(key, b"inst/7")  # an earlier beat of its own that landed late
    assert ring.beat() is None and bytes(store.get(key)) == b"inst/2"
    store.set(key, b"lost/1/abc")  # another node declared it lost
    assert ring.beat() == b"lost/1/abc"
    assert bytes(store.get(key)) == b"lost/1/abc" and ring.mine == b"inst/2"


def test_the_scheduler_looks_at_the_deadline_between_beats(store: Any) -> None:
    prefix = f"ring-{uuid.uuid4().hex[:8]}/"
    store.set(f"{prefix}1", b"5")  # member 1 beat once and stopped
    found = threading.Event()
    silent: list[tuple[float, int]] = []

    def on_silent(m: int, secs: float, epoch: int, members: tuple[int, ...]) -> None:
        silent.append((secs, ring.sent))
        found.set()

    # a long interval: without a look at the deadline the verdict would wait for a beat
    ring = RingWatch(
        store.clone(), lambda m: f"{prefix}{m}", me=0, interval=5.0, timeout=0.5, window=1,
        members=lambda: (0, (0, 1)), on_silent=on_silent,
    )  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=ring.run, args=(stop,))
    thread.start()
    try:
        assert found.wait(30.0)
    finally:
        stop.set()
        thread.join(10.0)
    assert not thread.is_alive()
    secs, beats = silent[0]
    assert beats == 1 and 0.5 <= secs < 5.0  # judged at its deadline, before the second beat


def test_the_ring_imports_no_torch() -> None:
    # the sidecar process imports the rings; it talks to the store without torch
    code = (
        "import sys\n"
        "import trainguard.coord.liveness, trainguard.restart.sidecar._watch\n"
        "import trainguard.coord.node_ring, trainguard.restart.sidecar._node\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
