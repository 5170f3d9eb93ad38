"""A local root that nobody but this user can read or plant files in.

Local roots often live in world-writable places (``/dev/shm``, ``/tmp``), where another user
could create the root first (and then read every part, or plant files the manager would load or
remove), or plant a symlink in its place. :func:`prepare_root` creates the root (and any missing
parent) with mode 0700, then refuses a root that is not a directory, that is owned by another
user, or that group or others may write, and a root that is a symlink owned by another user.
Only the root itself is checked, not its parents: ``/dev/shm`` itself (mode 1777) is fine.

The manager creates iteration directories with mode 0700 (see :func:`make_private_dir`) and
its parts are made 0600 once written.
"""

from __future__ import annotations

import contextlib
import os
import stat

from trainguard.errors import ConfigError

DIR_MODE = 0o700
PART_MODE = 0o600


def problem(path: str, st: os.stat_result, *, uid: int) -> str | None:
    """What is wrong with the directory ``path`` (``st``: its stat) as a private root of the
    user ``uid``, with how to fix it; None when nothing is."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory; pass a directory (or a path that does not exist yet)"
    if st.st_uid != uid:
        return (
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}): another user "
            f"could read the parts or plant files in it. Use a path of your own (e.g. "
            f"{os.path.join(os.path.dirname(path), 'ckpt-' + str(uid))}), or "
            f"`chown {uid} {path}` if it is yours"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: group or others may write in it "
            f"and plant files. Run `chmod 700 {path}` or use another path"
        )
    return None


def make_private_dir(path: str) -> None:
    """Create the directory ``path`` (mode 0700) unless it exists."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)


def prepare_root(root: str) -> None:
    """Create ``root`` (0700) if missing, then check it (see the module's docstring).

    Raises :class:`ConfigError` naming the path and the fix.
    """
    uid = os.geteuid()
    try:
        link = os.lstat(root)
    except FileNotFoundError:
        link = None
    except OSError as exc:
        raise ConfigError(f"local checkpoint root {root}: {exc}") from exc
    if link is not None and not stat.S_ISDIR(link.st_mode) and not stat.S_ISLNK(link.st_mode):
        raise ConfigError(
            f"local checkpoint root {root} exists and is not a directory; pass a directory "
            "(or a path that does not exist yet)"
        )
    if link is not None and stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise ConfigError(
            f"local checkpoint root {root} is a symlink owned by uid {link.st_uid}, not by this "
            f"user (uid {uid}): another user chose where the parts go. Remove it or use "
            "another path"
        )
    try:
        _make_dirs(root)
        st = os.stat(root)
    except OSError as exc:
        raise ConfigError(f"cannot create the local checkpoint root {root}: {exc}") from exc
    why = problem(root, st, uid=uid)
    if why is not None:
        raise ConfigError(f"local checkpoint root refused: {why}")


def _make_dirs(path: str) -> None:
    """``os.makedirs`` with mode 0700 for every directory it creates."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _make_dirs(parent)
    make_private_dir(path)


def is_directory(path: str) -> bool:
    """Whether ``path`` is a directory itself (a symlink to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
