"""The monitor's abort order, in one process (a store in memory, the abort recorded)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import trainguard.restart.monitor as monitor_module
from trainguard.coord.keys import Keyspace
from trainguard.restart.monitor import Monitor
from trainguard.restart.state import RestartInterrupt, RoundOutcome


class _Store:
    """The store calls the monitor makes: ``wait``, ``get``, ``compare_set``."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else value
            self._cond.notify_all()

    def wait(self, keys: list[str], timeout: Any) -> None:
        with self._cond:
            self._cond.wait_for(lambda: all(k in self._data for k in keys))

    def get(self, key: str) -> bytes:
        return self._data[key]

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        with self._cond:
            if key not in self._data:
                self.set(key, desired)
            return self._data[key]


def _abort_round(monkeypatch: pytest.MonkeyPatch, settle_s: float, body: Any) -> dict[str, Any]:
    """Round 0 of a monitor fails while the main thread runs ``body()`` inside the function;
    returns what the abort of torch.distributed saw."""
    seen: dict[str, Any] = {}
    release = threading.Event()
    keys = Keyspace("job")
    store = _Store()
    monitor = Monitor(store, keys, threading.get_ident())
    monitor.settle_s = settle_s

    def abort() -> dict[str, Any]:
        seen["in_fn"] = monitor.in_function
        seen["time"] = time.monotonic()
        release.set()  # the sockets' shutdown releases a collective that was waiting
        return {}

    monkeypatch.setattr(monitor_module, "abort_distributed", abort)
    monitor.watch(0)
    monitor.enter_fn(0)
    try:
        store.set(keys.stop(0), RoundOutcome.fault(1, "ValueError: x", "ValueError").encode())
        seen["start"] = time.monotonic()
        with pytest.raises(RestartInterrupt):
            body(release)
    finally:
        monitor.leave_fn()
    outcome = monitor.wait_outcome(10)
    monitor.close()
    assert outcome is not None and outcome.why == "fault" and outcome.rank == 1
    return seen


def test_main_thread_running_python_leaves_before_the_abort(monkeypatch) -> None:
    """Between two collectives the main thread runs Python code: the interrupt must land
    before the group's sockets go down, or its next collective may start while gloo closes
    them and stay blocked for good (seen under load)."""

    def python_code(release: threading.Event) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pass

    seen = _abort_round(monkeypatch, 20.0, python_code)
    assert seen["in_fn"] is False


def test_main_thread_blocked_in_a_collective_does_not_delay_the_abort(monkeypatch) -> None:
    """A main thread waiting in C code cannot take the interrupt: the abort goes on after
    ``settle_s``, its shutdown releases the wait, and then the interrupt lands."""

    def collective(release: threading.Event) -> None:
        assert release.wait(20)  # stands for work.wait(): the GIL released, no bytecode
        time.sleep(0)

    seen = _abort_round(monkeypatch, 0.2, collective)
    assert seen["in_fn"] is True
    assert seen["time"] - seen["start"] < 5


def test_the_interrupt_never_lands_inside_an_import(monkeypatch, tmp_path) -> None:
    """A module whose top-level code runs when the round aborts (torch imports some of its
    modules at first use, often in a spare's first round) is imported completely first: an
    interrupt inside it would leave it half-initialized, and every later import of it fails."""
    import importlib
    import sys

    name = "_trainguard_slow_module"
    (tmp_path / f"{name}.py").write_text(
        "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end:\n"
        "    pass\nDONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def slow_import(release: threading.Event) -> None:
        importlib.import_module(name)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # Python code: the interrupt lands here
            pass

    try:
        _abort_round(monkeypatch, 5.0, slow_import)
        assert sys.modules[name].DONE is True
    finally:
        sys.modules.pop(name, None)


def _stuck_after(monkeypatch: pytest.MonkeyPatch, phase_s: float | None, cap: float) -> float:
    """Seconds from the abort to the stuck report of a main thread blocked in C code for 3 s;
    ``phase_s``: it is in a bounded constructor's connect phase ending that much later."""
    from trainguard.restart import _setup

    keys, store = Keyspace("job"), _Store()
    stuck: list[float] = []
    monitor = Monitor(
        store,
        keys,
        threading.get_ident(),
        hooks=monitor_module.MonitorHooks(stuck=lambda n: stuck.append(time.monotonic())),
        abort_timeout=0.3,
        setup_cap=cap,
    )
    monkeypatch.setattr(monitor_module, "abort_distributed", lambda: {})
    tid = threading.get_ident()
    monitor.watch(0)
    monitor.enter_fn(0)
    start = time.monotonic()
    if phase_s is not None:
        monkeypatch.setitem(_setup.SetupBound._connecting, tid, start + phase_s)
    try:
        store.set(keys.stop(0), RoundOutcome.fault(1, "ValueError: x", "ValueError").encode())
        with pytest.raises(RestartInterrupt):
            threading.Event().wait(3.0)  # the GIL released, no bytecode: the interrupt waits
            time.sleep(0)
    finally:
        monitor.leave_fn()
    monitor.wait_outcome(10)
    monitor.close()
    assert len(stuck) == 1
    return stuck[0] - start


def test_a_main_thread_in_a_constructor_s_connect_phase_is_given_until_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # restart._setup: the constructor raises by the phase's end; abort_timeout after it
    assert 1.2 <= _stuck_after(monkeypatch, 1.0, cap=5.0) < 2.5
    # never past the cap (the others wait at the next barrier meanwhile)
    assert 0.5 <= _stuck_after(monkeypatch, 2.0, cap=0.6) < 1.1
    # elsewhere: abort_timeout, as before
    assert _stuck_after(monkeypatch, None, cap=5.0) < 1.0
