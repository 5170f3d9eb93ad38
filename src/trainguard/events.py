"""Structured event log: one JSON object per line, one file per process.

Every fault, detection, abort, restart round, save, commit and load is recorded as an event::

    {"time": 1764680000.123, "host": "node7", "pid": 4242, "rank": 3, "round": 1,
     "kind": "abort", "duration": 0.0021, ...free fields...}

``time`` is wall-clock (:func:`time.time`) at the moment of the event (for a span, its end);
``duration`` is measured with a monotonic clock and present only where it applies.

Writing: enabled when a directory is configured (:func:`configure` or ``TRAINGUARD_EVENTS_DIR``).
Each process appends to ``<dir>/events-<host>-<pid>.jsonl`` with one ``os.write`` per line on an
``O_APPEND`` descriptor, so lines from several threads never interleave and a process killed
mid-write leaves at most one torn line at the end, which :func:`read_events` skips. When
disabled, :func:`emit` costs one attribute check.

Reading: :func:`read_events` merges every file of a run directory in time order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard import _env

__all__ = [
    "EventLog",
    "configure",
    "emit",
    "get_log",
    "read_events",
    "set_context",
    "span",
    "well_formed",
]

logger = logging.getLogger(__name__)

_RESERVED = ("time", "host", "pid", "rank", "round", "kind", "duration")
#: Fields that, where present, hold an integer (or null): ranks, rounds, steps, process ids.
_INTEGERS = ("pid", "rank", "round", "step", "gone_rank", "gone_round", "fault_rank")
#: Fields that, where present, hold a string (or null); the report reads others with str().
_STRINGS = ("kind", "host")


def _finite(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


def well_formed(event: object) -> bool:
    """Whether ``event`` is an object whose known fields have their types: a finite ``time``,
    a finite ``duration`` >= 0, integers (:data:`_INTEGERS`) and strings (:data:`_STRINGS`)
    where present. :func:`read_events` and the report skip any other line."""
    if not isinstance(event, dict) or not _finite(event.get("time")):
        return False
    duration = event.get("duration")
    if duration is not None and not (_finite(duration) and duration >= 0):
        return False
    return all(event.get(k) is None or type(event[k]) is int for k in _INTEGERS) and all(
        event.get(k) is None or isinstance(event[k], str) for k in _STRINGS
    )


class EventLog:
    """Appends events of this process to ``<directory>/events-<host>-<pid>.jsonl``.

    ``directory=None`` gives a disabled log whose :meth:`emit` does nothing. The log is safe to
    use from several threads. ``rank`` and ``round`` are stamped on every event; change them
    with :meth:`set_context` when a restart round begins.
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None, *, rank: int | None = None
    ) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.host = socket.gethostname()
        self.rank = rank
        self.round: int | None = None
        self._fd: int | None = None
        self._pid = -1
        self._lock = threading.Lock()
        if self.directory is not None:
            self._open()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @property
    def path(self) -> Path | None:
        """This process's file, or None when disabled."""
        if self.directory is None:
            return None
        return self.directory / f"events-{self.host}-{os.getpid()}.jsonl"

    def _open(self) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path
        assert path is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        # A recycled pid may find the torn last line of a dead process: end it first so that
        # our first event starts on a line of its own.
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")
        self._fd = fd
        self._pid = os.getpid()

    def set_context(self, *, rank: int | None = None, round: int | None = None) -> None:
        """Set the rank and restart round stamped on later events (None leaves one as is)."""
        if rank is not None:
            self.rank = rank
        if round is not None:
            self.round = round

    def emit(self, kind: str, *, duration: float | None = None, **fields: Any) -> None:
        """Record one event of ``kind`` with optional ``duration`` (seconds) and free fields."""
        if self.directory is None:
            return
        event: dict[str, Any] = {
            "time": time.time(),
            "host": self.host,
            "pid": os.getpid(),
            "rank": self.rank,
            "round": self.round,
            "kind": kind,
        }
        if duration is not None:
            event["duration"] = duration
        for key, value in fields.items():
            if key in _RESERVED:
                key = f"field_{key}"
            event[key] = value
        line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._pid != os.getpid():  # forked child: never write into the parent's file
                self._open()
            if self._fd is None:
                return
            try:
                os.write(self._fd, line)
            except OSError as exc:  # a full disk must never break training
                logger.warning("event log write to %s failed: %s", self.path, exc)

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Time a block; emits ``kind`` at its end with ``duration``.

        The yielded dict may be filled with more fields inside the block. If the block raises,
        the event carries ``error`` (the exception's type name) and the exception propagates.
        """
        extra: dict[str, Any] = dict(fields)
        start = time.monotonic()
        try:
            yield extra
        except BaseException as exc:
            extra["error"] = type(exc).__name__
            raise
        finally:
            self.emit(kind, duration=time.monotonic() - start, **extra)

    def close(self) -> None:
        """Close the file; later events are dropped."""
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None
            self.directory = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_log: EventLog | None = None
_log_lock = threading.Lock()


def get_log() -> EventLog:
    """The process-wide log; built on first use from ``TRAINGUARD_EVENTS_DIR`` (or disabled)."""
    global _log
    log = _log
    if log is None:
        with _log_lock:
            if _log is None:
                _log = EventLog(_env.settings().events_dir)
            log = _log
    return log


def configure(directory: str | os.PathLike[str] | None, *, rank: int | None = None) -> EventLog:
    """Replace the process-wide log with one writing to ``directory`` (None disables it)."""
    global _log
    with _log_lock:
        if _log is not None:
            _log.close()
        _log = EventLog(directory, rank=rank)
        return _log


def emit(kind: str, *, duration: float | None = None, **fields: Any) -> None:
    """Record an event in the process-wide log (see :meth:`EventLog.emit`)."""
    get_log().emit(kind, duration=duration, **fields)


def span(kind: str, **fields: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """Time a block in the process-wide log (see :meth:`EventLog.span`)."""
    return get_log().span(kind, **fields)


def set_context(*, rank: int | None = None, round: int | None = None) -> None:
    """Set rank and round on the process-wide log."""
    get_log().set_context(rank=rank, round=round)


def read_events(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Merge every ``events-*.jsonl`` file under ``directory`` into one list in time order.

    Lines that are not complete JSON objects (a torn last line of a killed process), and
    objects whose known fields have the wrong types (:func:`well_formed`), are skipped. Events with equal times keep their order within a file.
    """
    events: list[tuple[float, int, int, dict[str, Any]]] = []
    for file_index, path in enumerate(sorted(Path(directory).glob("events-*.jsonl"))):
        with open(path, "rb") as f:
            for line_index, raw in enumerate(f):
                if not raw.endswith(b"\n"):
                    continue  # torn: the writer died before finishing this line
                try:
                    event = json.loads(raw)
                except (ValueError, RecursionError):
                    event = None
                if not well_formed(event):
                    logger.debug("skipping malformed line %d of %s", line_index + 1, path)
                    continue
                events.append((float(event["time"]), file_index, line_index, event))
    events.sort(key=lambda item: item[:3])
    return [item[3] for item in events]
