"""Safe overwrite: a save to a committed checkpoint directory is written beside it and swapped in.

A multi-rank save to a directory ``D`` that already holds a committed checkpoint (or whose
earlier swap a crash interrupted) writes every rank's part into a fresh sibling,
``.D.tg-new-<token>``, and commits it there (the ``COMMITTED`` marker). Then one process (DCP's
coordinator in ``finish``; the rank that commits an
:class:`~trainguard.checkpoint.AsyncCheckpointer` save) swaps it in, before any rank learns that
the save was committed:

1. exchange ``D`` and the sibling in one step (``renameat2(RENAME_EXCHANGE)``, see
   :mod:`._exchange`), fsync the parent directory: ``D`` is the new checkpoint, the sibling's
   name holds the old one;
2. rename that to ``.D.tg-old-<token>``, fsync the parent directory;
3. remove the old one.

At no instant is there no ``D``: a reader that opens ``D`` gets one whole directory, old or
new, and reads it through that descriptor (see :mod:`._load`). Where the file system refuses
the exchange (``EINVAL``/``ENOSYS``: some network and FUSE file systems), two renames do it
instead (``D`` to ``.D.tg-old-<token>``, the sibling to ``D``), and for that instant ``D`` is
missing: a reader that finds no ``D`` then settles the swap itself (:func:`settle`; safe beside the
swap's own process: whichever renames the new one in first wins, the other finds it done) and
looks again.

A crash (SIGKILL) at any instant leaves one of four states: (a) ``D`` old and committed, the
sibling partial; (b) ``D`` old, the sibling committed; (c) no ``D``, the old and the new one
committed beside it (two renames only); (d) ``D`` new, the old one still beside it (under
either name: which one is older is told by their markers' times). :func:`settle`, run by every
reader (``load``, ``latest``, DCP's ``StorageReader``), turns (c) into (d) with one rename and
never removes anything, so a reader always finds one complete checkpoint at ``D``, old or new.
:func:`recover`, run by the one process that commits the next save to ``D``, also finishes (b)
and removes the leftovers of (a) and (d). Sibling names start with a dot and are never taken
for checkpoints by :func:`~trainguard.checkpoint.latest`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal

from trainguard import _env
from trainguard.checkpoint import _exchange
from trainguard.checkpoint._commit import MARKER, refuse_overwrite
from trainguard.checkpoint.format.write import fsync_dir

__all__ = [
    "committed",
    "finish",
    "is_leftover",
    "kill_point",
    "leftover_of",
    "needs_sibling",
    "recover",
    "settle",
    "settle_root",
    "sibling",
    "sibling_time",
    "swap",
    "token",
    "write_dir",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^\.(?P<name>.+)\.tg-(?P<kind>new|old)-(?P<token>[0-9a-f]{16})$")


def token(seed: str | None = None) -> str:
    """A sibling token: derived from ``seed`` (the same on every rank of one save), or random."""
    if seed is None:
        return secrets.token_hex(8)
    return hashlib.sha1(seed.encode()).hexdigest()[:16]


def _split(directory: str) -> tuple[str, str]:
    path = os.path.abspath(directory)
    return os.path.dirname(path), os.path.basename(path)


def sibling(directory: str, tok: str, kind: str = "new") -> str:
    """The sibling of ``directory`` where a save with token ``tok`` writes (``kind="new"``), or
    where the swap parks the checkpoint it replaces (``kind="old"``)."""
    parent, name = _split(directory)
    return os.path.join(parent, f".{name}.tg-{kind}-{tok}")


def is_leftover(name: str) -> bool:
    """Whether a directory entry's name is one of a swap's siblings (never a checkpoint)."""
    return _NAME.match(name) is not None


def leftover_of(name: str) -> str | None:
    """The name of the checkpoint a swap sibling named ``name`` belongs to; None when ``name``
    is no sibling."""
    match = _NAME.match(name)
    return None if match is None else match["name"]


def sibling_time(directory: str) -> float | None:
    """The commit time of the newest committed sibling of ``directory`` (None: none is)."""
    times = [t for _, path in _siblings(directory) if (t := _marker_time(path)) is not None]
    return max(times, default=None)


def committed(directory: str) -> bool:
    """Whether ``directory`` holds a commit marker."""
    return os.path.lexists(os.path.join(directory, MARKER))


def _marker_time(directory: str) -> float | None:
    try:
        return os.lstat(os.path.join(directory, MARKER)).st_mtime
    except OSError:
        return None


def _siblings(directory: str) -> list[tuple[str, str]]:
    """``(kind, path)`` of every sibling of ``directory``, newest commit first."""
    parent, name = _split(directory)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found: list[tuple[float, str, str]] = []
    for entry in names:
        match = _NAME.match(entry)
        if match is None or match["name"] != name:
            continue
        path = os.path.join(parent, entry)
        when = _marker_time(path)
        found.append((-1.0 if when is None else when, match["kind"], path))
    found.sort(reverse=True)
    return [(kind, path) for _, kind, path in found]


def needs_sibling(directory: str) -> bool:
    """Whether a save to ``directory`` must be written beside it: it is committed, or a swap
    a crash interrupted left a committed checkpoint (or the one it replaced) beside it. Nothing
    that :func:`settle` or :func:`recover` does turns this from True to False, so every rank
    of a save that asks decides the same."""
    if committed(directory):
        return True
    return any(kind == "old" or committed(path) for kind, path in _siblings(directory))


def write_dir(directory: str, *, seed: str | None, overwrite: bool, busy: bool = False) -> str:
    """Where a save to the checkpoint directory ``directory`` writes: ``directory`` itself,
    or a sibling (named after ``seed``, the same on every rank of one save) when it must not
    be touched before the new checkpoint is committed. :class:`CheckpointError` when ``busy``
    (an earlier save to it is not finished) or, with ``overwrite=False``, when it is a committed
    checkpoint."""
    if busy or not overwrite:
        settle(directory)
        refuse_overwrite(directory, busy=busy)
    if overwrite and needs_sibling(directory):
        return sibling(directory, token(seed))
    return directory


def finish(new: str, directory: str) -> None:
    """After the checkpoint at the sibling ``new`` was committed: :func:`recover` what earlier
    saves left, then :func:`swap` it in."""
    recover(directory, keep=new)
    swap(new, directory)


def kill_point(point: str) -> None:
    """Fault injection for tests: SIGKILL this process at ``point`` when
    ``TRAINGUARD_OVERWRITE_KILL_AT`` names it."""
    if _env.settings().overwrite_kill_at == point:
        os.kill(os.getpid(), signal.SIGKILL)


def settle(directory: str) -> bool:
    """A reader's recovery: when ``directory`` is missing and an interrupted swap left its
    checkpoint beside it, rename that into place (the new one first). Removes nothing; safe
    to run in many processes at once. True when ``directory`` was put back; a file system
    that refuses the rename (read-only) is logged, and the reader then finds no checkpoint."""
    if os.path.lexists(directory):
        return False
    ready = [path for kind, path in _siblings(directory) if committed(path)]
    ready.sort(key=lambda p: 0 if ".tg-new-" in os.path.basename(p) else 1)
    for path in ready:
        try:
            os.rename(path, directory)
        except FileNotFoundError:
            continue  # another process took it
        except OSError as exc:
            if not os.path.lexists(directory):  # else another process settled it first
                logger.warning("cannot finish the interrupted overwrite of %s: %s", directory, exc)
            return False
        with contextlib.suppress(OSError):
            fsync_dir(_split(directory)[0])
        logger.info("finished an interrupted overwrite: %s is now %s", path, directory)
        return True
    return False


def settle_root(root: str) -> None:
    """:func:`settle` every checkpoint directly under ``root`` that has swap siblings."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in {m["name"] for n in names if (m := _NAME.match(n)) is not None}:
        settle(os.path.join(root, name))


def recover(directory: str, *, keep: str | None = None) -> None:
    """The saver's recovery, by the one process that commits saves to ``directory`` (never
    while another save to it runs): :func:`settle`, finish a swap whose new checkpoint was
    committed, remove partial siblings (except ``keep``, the current save's) and old ones."""
    settle(directory)
    siblings = [(kind, path) for kind, path in _siblings(directory) if path != keep]
    newest = next((p for k, p in siblings if k == "new" and committed(p)), None)
    here = _marker_time(directory)
    if newest is not None and here is not None and (_marker_time(newest) or 0.0) > here:
        # committed after the one at directory (not the old one an exchange parked there)
        swap(newest, directory, inject=False)
        siblings = [(k, p) for k, p in siblings if p != newest]
    for kind, path in siblings:
        if kind == "new" or committed(directory):
            logger.info("removing %s, left by an interrupted save to %s", path, directory)
            shutil.rmtree(path, ignore_errors=True)


def swap(new: str, directory: str, *, inject: bool = True) -> None:
    """Put the committed checkpoint at ``new`` in place of ``directory`` (see the module
    docstring). On an error the checkpoint at ``directory`` is the one it was, and ``new`` is
    no longer committed (the next save removes it)."""
    if inject:
        kill_point("committed")
    parent = _split(directory)[0]
    match = _NAME.match(os.path.basename(new))
    old = sibling(directory, match["token"] if match else token(), "old")
    if _exchanged(new, directory, old, inject):
        return
    moved = False
    try:
        if os.path.lexists(directory):
            os.rename(directory, old)
            fsync_dir(parent)
            moved = True
            if inject:
                kill_point("old-moved")
        try:
            os.rename(new, directory)
        except OSError:
            if not (committed(directory) and not os.path.lexists(new)):
                raise
            # a reader's settle() already moved it in
        fsync_dir(parent)
    except BaseException:
        if moved and not os.path.lexists(directory):
            with contextlib.suppress(OSError):
                os.rename(old, directory)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(new, MARKER))
        raise
    if inject:
        kill_point("new-moved")
    if moved:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("overwrote %s with the checkpoint committed at %s", directory, new)


def _exchanged(new: str, directory: str, old: str, inject: bool) -> bool:
    """Steps 1 to 3 of the swap with one exchange; False (nothing changed) where the file
    system refuses it, or ``directory`` is missing: then two renames must do."""
    try:
        _exchange.exchange(new, directory)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if _exchange.refused(exc):
            logger.debug("no atomic exchange of %s (%s): two renames instead", directory, exc)
            return False
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(new, MARKER))
        raise
    parent = _split(directory)[0]
    with contextlib.suppress(OSError):  # the swap is done; only its durability is in doubt
        fsync_dir(parent)
    if inject:
        kill_point("old-moved")
    try:
        os.rename(new, old)  # what the exchange parked there is the old checkpoint
        fsync_dir(parent)
    except OSError as exc:  # the next save's recover() removes it (its marker is older)
        logger.warning("could not move the replaced checkpoint aside to %s: %s", old, exc)
        return True
    if inject:
        kill_point("new-moved")
    shutil.rmtree(old, ignore_errors=True)
    logger.info("overwrote %s with the checkpoint committed at %s", directory, new)
    return True
