"""A store process that cannot start is known at once on every rank (real ranks, a real port
taken by another listener, the real store process failing on it)."""

from __future__ import annotations

import os
import socket

from tests._dist import free_port, run_ranks
from tests.restart import _jobs
from trainguard.coord._startfail import _SLACK, _STARTED, StartNotice


def test_other_ranks_fail_within_seconds_with_the_store_process_error() -> None:
    port = free_port()
    with socket.create_server(("127.0.0.1", port)) as taken:  # listens, never answers
        results = run_ranks(_jobs.store_start_job, 3, timeout=45, env={"MASTER_PORT": str(port)})
        assert taken.fileno() >= 0
    values = [r.get() for r in results]
    root = values[0]
    assert root["type"] == "CoordinationError"
    assert "the store process could not start" in root["error"]
    assert f"127.0.0.1:{port}" in root["error"]
    for rank, value in enumerate(values[1:], start=1):
        assert value["type"] == "CoordinationError", (rank, value)
        assert value["error"].startswith("rank 0 could not start the coordination store: ")
        assert root["error"] in value["error"]  # the store process's own error
        # within one connect attempt (1 s) of rank 0's failure; 60 s (store_timeout) or, on
        # this taken port, a hang in torch's client before
        assert value["at"] - root["at"] < 5, (rank, value, root)
        assert value["seconds"] < 30, (rank, value)  # rank 0's store process starts meanwhile


def test_an_earlier_attempts_notice_is_not_taken_for_this_ones(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    notice = StartNotice("job", 0, "127.0.0.1", 1234)
    assert notice.read() is None
    notice.publish("port in use")
    assert notice.failure() == "rank 0 could not start the coordination store: port in use"
    old = _STARTED - _SLACK - 1
    os.utime(notice.path, (old, old))  # written before this process started
    assert notice.read() is None
    assert StartNotice("job", 1, "127.0.0.1", 1234).path != notice.path  # another call
    notice.clear()
    assert not notice.path.exists()
