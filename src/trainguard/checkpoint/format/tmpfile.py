"""Temporary files that nobody can plant: the first step of every atomic write.

A file that appears under its final name only complete is written first as a temporary file
next to it, then renamed over the final name. The temporary name is unpredictable
(``.NAME.<random>.tmp``: hidden, and still ending in ``.tmp``, so every scan that skips ``.tmp``
files skips it), it is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a symlink or file
planted under that name makes the open fail instead of writing through it) and mode 0600 until
it is complete; :func:`publish` then gives it its final mode and renames it into place
(``rename`` replaces a symlink planted at the final name; it never follows it).

Every writer of a checkpoint file, a commit marker or a local part uses it:
:func:`create`, write, fsync, :func:`publish` (or :func:`seal`, then rename later); on an
error :func:`discard`. A caller that
cannot know the temporary name (the writer process died mid-write) removes the leftovers of
``path`` with :func:`remove_leftovers`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TRIES = 16


def _pattern(path: str, token: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{token}.tmp")


def create(path: str) -> tuple[int, str]:
    """Create a new temporary file for ``path`` in its directory: ``(fd, tmp_path)``.

    The file is new (never an existing file or a symlink's target), mode 0600, open for writing.
    """
    for _ in range(_TRIES):
        tmp = _pattern(path, secrets.token_hex(8))
        try:
            return os.open(tmp, _FLAGS, 0o600), tmp
        except FileExistsError:  # planted, or (one in 2**64) taken: draw another name
            continue
    raise FileExistsError(f"could not create a temporary file next to {path}")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def seal(fd: int, *, mode: int = 0o644) -> None:
    """Give a complete temporary file (open as ``fd``) its final ``mode``, less the umask."""
    os.fchmod(fd, mode & ~_umask())


def publish(fd: int, tmp: str, path: str, *, mode: int = 0o644) -> None:
    """:func:`seal` the complete temporary file ``tmp`` (open as ``fd``) and rename it to
    ``path``. The caller closes ``fd`` and fsyncs the directory."""
    seal(fd, mode=mode)
    os.rename(tmp, path)


def discard(tmp: str) -> None:
    """Remove a temporary file that will not be published (gone already is fine)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def remove_leftovers(path: str) -> None:
    """Remove every temporary file of ``path`` (after its writer died mid-write)."""
    for tmp in leftovers(path):
        discard(tmp)


def leftovers(path: str) -> list[str]:
    """The temporary files of ``path`` that exist (a save that never completed)."""
    return glob.glob(_pattern(glob.escape(path), "*"))
