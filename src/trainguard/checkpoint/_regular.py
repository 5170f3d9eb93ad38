"""Opening checkpoint files to read: regular files only, and never blocking on the open.

A FIFO named like a part, a commit marker or DCP's ``.metadata`` would block a plain ``open``
for reading until some writer appears (forever), and a device could stream without end.
:func:`regular_only` is an ``opener`` for :func:`open` (``open(path, "rb",
opener=regular_only)``): it opens with ``O_NONBLOCK`` (which returns at once for a FIFO), and
refuses with :class:`CheckpointCorruptError` anything that is not a regular file. A symlink to
a regular file is followed, as checkpoints may be linked into place.
"""

from __future__ import annotations

import os
import stat

from trainguard.errors import CheckpointCorruptError

__all__ = ["open_regular", "regular_only"]


def regular_only(path: str | bytes, flags: int) -> int:
    """A descriptor of ``path`` opened with ``flags`` plus ``O_NONBLOCK | O_CLOEXEC``, if it
    is a regular file; :class:`CheckpointCorruptError` naming it otherwise."""
    return open_regular(path, flags)


def open_regular(path: str | bytes, flags: int = os.O_RDONLY, *, dir_fd: int | None = None) -> int:
    """:func:`regular_only`, ``path`` taken relative to the directory descriptor ``dir_fd``
    when one is given (how a checkpoint directory opened once is read)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else "a device or socket"
            )
            raise CheckpointCorruptError(
                f"{os.fsdecode(path)} is {kind}, not a regular file: it is no checkpoint file "
                "(remove it, or load another checkpoint)"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
