"""Files of this user only: a private directory, and files opened without following links.

:func:`private_dir` is ``<tmp>/trainguard-<uid>``, created mode 0700 and refused when another
user owns it or others may write it (anyone can create a name under ``/tmp`` first).
:func:`open_append` opens a file for appending with ``O_NOFOLLOW``, mode 0600, and refuses
anything that is not a regular file, so a planted link or directory is never written through.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from trainguard.errors import ConfigError

__all__ = ["open_append", "private_dir"]


def private_dir() -> Path:
    """This user's private directory (created on first use)."""
    path = Path(tempfile.gettempdir()) / f"trainguard-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    ):
        raise ConfigError(
            f"{path} is not a directory that only this user can use (owner uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it, or point TMPDIR "
            "elsewhere"
        )
    return path


def open_append(path: str | os.PathLike[str]) -> int:
    """A descriptor of ``path`` opened for appending (created 0600), never through a link.

    Raises ``OSError`` for a symbolic link, a directory or any other non-regular file.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd
