"""RingWatch, what every liveness ring runs on (beat, read, clocks, starvation, the scheduler),
driven through the node ring: a fake clock (the only fake) against a real TCPStore.

Each test builds a ring of nodes on one store client (the looks run one after another on this
thread) and moves the clock itself; the scheduler's test runs the real one.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from typing import Any

from trainguard.coord.liveness import RingWatch, ring_after
from trainguard.coord.node_ring import NodeRing

INTERVAL = 1.0
TIMEOUT = 3.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ring:
    """``n`` nodes of one rank each on one fake clock; :meth:`tick` moves it one interval and
    lets every running node beat and look, in node order."""

    def __init__(self, store: Any, n: int, window: int) -> None:
        self.clock = FakeClock()
        self.prefix = f"ring-{uuid.uuid4().hex[:8]}/"  # this test's own keys
        self.silent: list[tuple[int, int, float]] = []  # (watcher, member, secs)
        self.members = tuple(range(n))
        self.nodes = [self.make(store, m, window) for m in range(n)]
        self.running = set(self.members)

    def make(self, store: Any, me: int, window: int) -> NodeRing:
        def on_silent(m: int, ranks: list[int], secs: float, *_: Any) -> None:
            self.silent.append((me, m, secs))

        return NodeRing(
            store,
            lambda leader: f"{self.prefix}n/{leader}",
            position=lambda: ((me,), 0, self.members),
            interval=INTERVAL,
            timeout=TIMEOUT,
            window=window,
            on_silent=on_silent,
            clock=self.clock,
        )

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.clock.now += INTERVAL
            for m in sorted(self.running):
                self.nodes[m].beat_and_look()


def test_ring_order_wraps_around() -> None:
    assert ring_after(4, range(6)) == [5, 0, 1, 2, 3]
    assert ring_after(2, [7, 2, 0, 9]) == [7, 9, 0]
    assert ring_after(9, [7, 2, 0, 9]) == [0, 2, 7]


def test_a_paused_watcher_restarts_its_clocks_instead_of_judging(store: Any) -> None:
    ring = Ring(store, 3, window=2)
    ring.tick(3)
    # the whole machine stops for 10 s (a suspended VM): nobody beats, no clock is looked at
    ring.clock.now += 10.0
    ring.tick()  # the first look after it: every clock starts afresh, nobody is judged
    assert ring.silent == []
    ring.tick(10)  # everyone beats again: nobody is ever judged
    assert ring.silent == []
    # the clocks restarted, they were not switched off: a node that stays silent after the
    # pause is still judged, TIMEOUT after the restart
    ring.clock.now += 10.0
    ring.running.discard(1)
    ring.tick()  # restart (1's value as of the pause)
    ring.tick(2)
    assert ring.silent == []
    ring.tick()
    assert sorted((w, m) for w, m, _ in ring.silent) == [(0, 1), (2, 1)]
    assert all(secs >= TIMEOUT for _, _, secs in ring.silent), ring.silent


def test_a_gap_under_the_quiet_limit_counts_toward_silence(store: Any) -> None:
    # the contrast to the paused watcher: a look 1.5 s after the previous one (under
    # max(TIMEOUT / 2, 2 * INTERVAL) = 2 s) restarts no clock
    ring = Ring(store, 3, window=2)
    ring.tick(3)  # 2 saw 1's last beat at t0+3
    ring.running.discard(1)
    ring.tick()
    ring.clock.now += 0.5
    ring.tick()  # t0+5.5
    assert ring.silent == []
    ring.tick()  # t0+6.5: 3.5 s since 2 saw 1 move (a restart would have made it 1 s)
    assert [(w, m, s) for w, m, s in ring.silent if w == 2] == [(2, 1, 3.5)], ring.silent


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
    store.set(f"{prefix}1", b"1/x/5")  # node 1 (rank 1) beat once and stopped
    found = threading.Event()
    silent: list[tuple[float, int]] = []

    def on_silent(m: int, ranks: list[int], secs: float, *_: Any) -> None:
        silent.append((secs, ring.sent))
        found.set()

    # a long interval: without a look at the deadline the verdict would wait for a beat
    ring = NodeRing(
        store.clone(), lambda m: f"{prefix}{m}", position=lambda: ((0,), 0, (0, 1)),
        interval=5.0, timeout=0.5, window=1, on_silent=on_silent,
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
    # the node watcher's process imports the rings; it talks to the store without torch
    code = (
        "import sys\n"
        "import trainguard.coord.liveness, trainguard.restart.sidecar._watch\n"
        "import trainguard.coord.node_ring, trainguard.restart.sidecar._node\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
