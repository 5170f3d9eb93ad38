"""The store process's follower of the rounds (``_Host.published``): it learns that a round
started, so that it opens the store of the round after next and closes the last one's.

It waits for the round's ready key in short waits, and between two looks at
:attr:`Keyspace.latest` for a round published while it was not waiting (whose ready key may
already be deleted). Those looks are all it asks of the store while a round runs, five times a
second for the whole job: each must be a few requests, not one per round it might have missed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from trainguard.coord import Keyspace
from trainguard.coord._server import _CATCH_UP, _Host
from trainguard.coord._wire import WireStore
from trainguard.restart._records import RoundLayout

KEYS = Keyspace("t")


class _Counted:
    """A store client that counts its calls."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return attr(*args)

        return call


def _follower() -> _Host:
    host = object.__new__(_Host)  # its method alone: no store process, no round stores
    host.keys = KEYS
    return host


def _watcher(store: Any) -> _Counted:
    return _Counted(WireStore("127.0.0.1", store.port, timeout=30))


def test_a_round_published_while_it_was_not_waiting_is_found_in_one_look(store: Any) -> None:
    # rounds 3 and 4 were published and deleted before the follower waited for round 3;
    # round 5 runs (its key is there, copied to the latest round's)
    layout = RoundLayout(round=5, active=(0, 1), spare=()).encode()
    store.set(KEYS.ready(5), layout)
    store.set(KEYS.latest, layout)
    watcher = _watcher(store)
    start = time.monotonic()
    assert _follower().published(watcher, 3) == 5
    assert time.monotonic() - start < 5 * _CATCH_UP.total_seconds()
    # one wait that ran out, then the look: a check and a read of the latest round
    assert watcher.calls == ["wait", "check", "compare_set"], watcher.calls


def test_each_look_while_a_round_runs_is_two_requests(store: Any) -> None:
    store.set(KEYS.latest, RoundLayout(round=3, active=(0, 1), spare=()).encode())
    watcher = _watcher(store)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(_follower().published(watcher, 4)))
    thread.start()
    time.sleep(6 * _CATCH_UP.total_seconds())  # round 4 runs: about 6 looks
    store.set(KEYS.ready(4), b"{}")
    thread.join(10.0)
    assert got == [4]
    looks = watcher.calls.count("wait")
    assert looks >= 3, watcher.calls
    # per look a wait, a check and a read of the latest round (round 3: not later), and at the
    # end the check of round 4's key; before, each look checked the next 64 rounds' keys
    assert len(watcher.calls) <= 3 * looks + 1, watcher.calls


def test_a_latest_value_that_is_not_a_layout_is_no_round(store: Any) -> None:
    watcher = _watcher(store)
    host = _follower()
    assert host.latest(watcher) == -1  # none yet
    for raw in (b"not json", b"[1]", b'{"round": true}', b'{"round": "7"}', b"{}", b"\xff"):
        store.set(KEYS.latest, raw)
        assert host.latest(watcher) == -1, raw
    store.set(KEYS.latest, RoundLayout(round=7, active=(0,), spare=()).encode())
    assert host.latest(watcher) == 7
