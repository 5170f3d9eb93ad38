"""How a demo process reports to ``trainguard demo``: one channel per process, one message format.

A message is a tuple whose first item names its kind (``"hello"``, ``"reference"``, ``"step"``,
``"fault"``, ``"resumed"``, ``"done"``, ``"idle"``, ``"error"``; see
:mod:`trainguard.demo.worker`). Two transports carry the same tuples:

- :class:`PipeChannel`: the write end of a one-way pipe (the demo starts the processes itself);
- :class:`FileChannel`: a JSON-lines file of this process alone (the processes are started by
  ``trainguard launch``, which the demo does not own). One ``os.write`` per line on an
  ``O_APPEND`` descriptor: a process killed mid-message leaves at most one torn last line,
  and never touches another process's file.

:class:`JsonlTail` reads such files as they grow (the demo reads the event log the same way).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Channel", "FileChannel", "JsonlTail", "PipeChannel"]


class Channel(Protocol):
    """Where one demo process sends its messages; sending never raises."""

    def send(self, *msg: Any) -> None: ...

    def close(self) -> None: ...


class PipeChannel:
    """Messages as pickled tuples on the write end of a ``multiprocessing`` pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, *msg: Any) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(msg)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


class FileChannel:
    """Messages as JSON arrays, one per line, appended to ``path`` (created with its folder)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
        )

    def send(self, *msg: Any) -> None:
        if self.fd is None:
            return
        line = json.dumps(list(msg), separators=(",", ":")) + "\n"
        with contextlib.suppress(OSError):
            os.write(self.fd, line.encode())

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class JsonlTail:
    """The complete JSON lines appended to the files ``directory/pattern`` since the last poll.

    Files may appear at any time; a line without its newline yet is kept for the next poll; a
    line that is not JSON is skipped.
    """

    def __init__(self, directory: str | os.PathLike[str], pattern: str) -> None:
        self.directory = Path(directory)
        self.pattern = pattern
        self.offsets: dict[Path, int] = {}

    def poll(self) -> list[Any]:
        """New values, file by file (in name order), each file's in its order."""
        found: list[Any] = []
        if not self.directory.is_dir():
            return found
        for path in sorted(self.directory.glob(self.pattern)):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[path] = offset + end
            for raw in data[:end].splitlines():
                try:
                    found.append(json.loads(raw))
                except ValueError:
                    continue
        return found
