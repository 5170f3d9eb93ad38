"""``peek`` reads a key without waiting, without setting it, and without waking its waiters."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from trainguard.restart._book import peek


def test_peek_of_a_missing_key_does_not_wake_a_process_waiting_for_it() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    waiter = TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    reader = TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    woken: list[float] = []

    def wait() -> None:
        start = time.monotonic()
        try:
            waiter.wait(["stop"], timedelta(seconds=2))
            woken.append(time.monotonic() - start)
        except Exception:  # the wait timed out: nobody woke it
            pass

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    for _ in range(3):
        assert peek(reader, "stop") is None
    thread.join(10)
    assert woken == []  # woken by a read, a waiter would read a key that is not there
    reader.set("stop", "x")
    assert peek(reader, "stop") == b"x"
    assert not reader.check(["other"]) and peek(reader, "other") is None
