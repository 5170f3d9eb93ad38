"""The structured event log: concurrent writers, torn lines, merged order, disabled cost."""

from __future__ import annotations

import json
import os
import threading
import time

from tests._dist import run_ranks
from trainguard import events


def _write_events(directory: str, n: int) -> int:
    log = events.EventLog(directory, rank=int(os.environ["RANK"]))
    threads = [
        threading.Thread(target=lambda t=t: [log.emit("tick", seq=i, thread=t) for i in range(n)])
        for t in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    return os.getpid()


def test_concurrent_writers_from_several_processes(tmp_path) -> None:
    n = 300
    results = run_ranks(_write_events, 4, args=(str(tmp_path), n), timeout=60)
    pids = {r.get() for r in results}
    files = sorted(tmp_path.glob("events-*.jsonl"))
    assert len(files) == 4
    merged = events.read_events(tmp_path)
    assert len(merged) == 4 * 3 * n
    assert {e["pid"] for e in merged} == pids
    assert {e["rank"] for e in merged} == {0, 1, 2, 3}
    # every line of every file is a complete event: no interleaving between threads
    for f in files:
        for line in f.read_text().splitlines():
            assert json.loads(line)["kind"] == "tick"
    times = [e["time"] for e in merged]
    assert times == sorted(times)
    # per thread, the sequence is kept in order
    for rank in range(4):
        for t in range(3):
            seqs = [e["seq"] for e in merged if e["rank"] == rank and e["thread"] == t]
            assert seqs == list(range(n))


def test_torn_last_line_is_skipped_and_later_writes_start_clean(tmp_path) -> None:
    log = events.EventLog(tmp_path, rank=0)
    log.emit("a")
    log.emit("b")
    log.close()
    path = next(tmp_path.glob("events-*.jsonl"))
    with open(path, "ab") as f:
        f.write(b'{"time": 1.0, "kind": "torn"')  # a writer died mid-line
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["a", "b"]
    # the same pid (a recycled pid, or this process again) appends: the torn line stays torn
    log = events.EventLog(tmp_path, rank=0)
    log.emit("c")
    log.close()
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["a", "b", "c"]


def test_merged_reader_orders_across_files(tmp_path) -> None:
    (tmp_path / "events-h1-1.jsonl").write_text(
        "\n".join(json.dumps({"time": t, "kind": f"x{t}"}) for t in (1.0, 4.0, 5.0)) + "\n"
    )
    (tmp_path / "events-h2-2.jsonl").write_text(
        "\n".join(json.dumps({"time": t, "kind": f"y{t}"}) for t in (2.0, 3.0, 6.0)) + "\n"
    )
    (tmp_path / "not-events.txt").write_text("ignored\n")
    kinds = [e["kind"] for e in events.read_events(tmp_path)]
    assert kinds == ["x1.0", "y2.0", "y3.0", "x4.0", "x5.0", "y6.0"]


def test_event_fields_and_span(tmp_path) -> None:
    log = events.EventLog(tmp_path, rank=3)
    log.set_context(round=2)
    log.emit("fault", cause="ValueError", time="user-field-kept")
    try:
        with log.span("abort", target="gloo") as extra:
            extra["sockets"] = 4
            time.sleep(0.01)
            raise RuntimeError("x")
    except RuntimeError:
        pass
    log.close()
    fault, abort = events.read_events(tmp_path)
    assert fault["kind"] == "fault" and fault["rank"] == 3 and fault["round"] == 2
    assert fault["cause"] == "ValueError" and fault["field_time"] == "user-field-kept"
    assert isinstance(fault["time"], float) and fault["pid"] == os.getpid() and fault["host"]
    assert "duration" not in fault
    assert abort["kind"] == "abort" and abort["duration"] >= 0.01
    assert abort["sockets"] == 4 and abort["target"] == "gloo" and abort["error"] == "RuntimeError"


def test_disabled_log_writes_nothing_and_costs_little(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRAINGUARD_EVENTS_DIR", raising=False)
    log = events.EventLog(None)
    assert not log.enabled and log.path is None
    start = time.perf_counter()
    for _ in range(100_000):
        log.emit("tick", x=1)
    per_call = (time.perf_counter() - start) / 100_000
    assert per_call < 5e-6  # generous; bench/events_overhead.py measures the real figure
    assert list(tmp_path.iterdir()) == []


def test_process_log_follows_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_EVENTS_DIR", str(tmp_path))
    monkeypatch.setattr(events, "_log", None)
    try:
        events.set_context(rank=5, round=1)
        events.emit("restart")
        with events.span("barrier"):
            pass
        kinds = [(e["kind"], e["rank"]) for e in events.read_events(tmp_path)]
        assert kinds == [("restart", 5), ("barrier", 5)]
    finally:
        events.get_log().close()
        monkeypatch.setattr(events, "_log", None)
