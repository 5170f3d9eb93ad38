"""The commit of a multi-rank checkpoint: the ``COMMITTED`` marker and the commit thread.

A checkpoint directory saved by N ranks is committed once every rank's part is durable. Each
save is one :class:`~trainguard.coord.commit.CommitRound` (every rank reports; the outcome is
decided once, by ``compare_set``; every rank acts only on that outcome). The rank whose report
completes the round checks that every rank reported its part durable, writes
a temporary marker (fsynced; see :mod:`.format.tmpfile`) *before* it decides, and only once "committed" is the decision
renames it to ``COMMITTED``, then publishes the outcome: a rank that sees "committed" finds the
marker in place. A rank that gives up waiting (``commit_timeout``) or abandons the save decides
"failed" first, so a late rank can never commit it; and no rank removes its part unless the
decided outcome is "failed".

:class:`Committer` runs the rounds of one :class:`~trainguard.checkpoint.AsyncCheckpointer`
in a thread of its own, in save order: every rank reports its saves in the same order (a save
that failed or was skipped before reaching the writer is reported too), or two ranks could each
wait for an outcome that needs the other's next report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from trainguard.checkpoint._link import StoreLink
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.write import fsync_dir
from trainguard.coord.commit import CommitRound, Outcome
from trainguard.errors import CheckpointError

logger = logging.getLogger(__name__)

MARKER = "COMMITTED"


def refuse_overwrite(directory: str, *, busy: bool = False) -> None:
    """Raise :class:`CheckpointError` when ``directory`` is a committed checkpoint, or
    ``busy`` (an earlier save to it is still being written or committed).

    A save never writes into one: its parts would replace the committed ones before the new
    checkpoint is committed, and a failure on any rank would then leave nothing loadable.
    """
    if busy:
        raise CheckpointError(
            f"a save to {directory} is still being written or committed; wait() for it before "
            "saving there again, or save to a new path"
        )
    if os.path.lexists(os.path.join(directory, MARKER)):
        raise CheckpointError(
            f"Checkpoint already exists: {directory} is already a committed checkpoint and this "
            "save has overwrite=False: "
            "save to a new path, pass overwrite=True (the new checkpoint then replaces it only "
            f"once committed), or remove {directory} first"
        )


class _Marker:
    """The commit marker of one directory, written in the three steps of a commit round."""

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        self.path = os.path.join(directory, MARKER)
        self.tmp = ""
        # the save id: the same in every part of this save (a reader checks it); random where
        # the parts carry none (DCP's)
        self.info = {**info, "save_id": info.get("save_id") or secrets.token_hex(8)}

    def prepare(self) -> None:
        """Write a temporary marker durably (everything that can fail, before the decision)."""
        fd, self.tmp = tmpfile.create(self.path)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**self.info, "time": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
                tmpfile.seal(f.fileno())
        except BaseException:
            self.discard()
            raise

    def act(self) -> None:
        """Rename it into place: the directory is committed."""
        try:
            os.rename(self.tmp, self.path)
        except OSError:
            self.discard()
            raise
        try:
            fsync_dir(os.path.dirname(self.path))
        except OSError as exc:  # the marker is there; only its durability is in doubt
            logger.warning("fsync of %s after the commit failed: %s", self.path, exc)

    def discard(self) -> None:
        if self.tmp:
            tmpfile.discard(self.tmp)


@dataclasses.dataclass
class Report:
    """One rank's report of one save, as the commit thread takes it.

    ``file`` is this rank's part (None for a save that failed or was skipped before it reached
    the writer: this rank already knows, the report keeps the others from waiting for it).
    ``done`` receives the causes (rank -> why; empty when committed). ``directory`` is where
    the parts and the marker are when not at ``path`` (a safe overwrite's sibling); ``then``
    runs right after the marker is in place, before any rank learns the outcome (the swap).
    ``save_id`` is the id every rank wrote into its part (:meth:`Committer.save_id`); the
    marker holds it too.
    """

    key: str
    path: str
    error: str | None
    file: str | None = None
    format: str | None = None
    done: Callable[[dict[int, str]], None] | None = None
    directory: str | None = None
    then: Callable[[], None] | None = None
    save_id: str = ""


class Committer:
    """The commit thread of one checkpointer; see the module docstring.

    Args:
        link: the checkpointer's place in the store (its key prefix).
        rank, world_size: this rank and the number of ranks that save.
        timeout: seconds a rank waits for the others' reports (``commit_timeout``).
    """

    def __init__(self, link: StoreLink, *, rank: int, world_size: int, timeout: float) -> None:
        self.link = link
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = link.client()
        # one random value all ranks of this checkpointer agree on (the first to ask sets it):
        # with the key of a save it makes a save id no other save has, whatever the store
        raw = self._store.compare_set(f"{link.prefix}/save-nonce", "", secrets.token_hex(8))
        self._nonce = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._occurrences: dict[str, int] = {}
        self._queue: queue.SimpleQueue[Report | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="trainguard-ckpt-commit", daemon=True
        )
        self._thread.start()

    def key(self, path: str) -> str:
        """Store prefix of the next save to ``path``: the path and how often this rank saved to
        it. Every rank computes the same key for the same save, whatever it did with earlier
        ones (a rank that skips or fails a save still reports it), so a late rank can never
        count toward the wrong checkpoint."""
        n = self._occurrences.get(path, 0)
        self._occurrences[path] = n + 1
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
        return f"{self.link.prefix}/{digest}/{n}"

    def save_id(self, key: str) -> str:
        """The id of the save at ``key`` (:meth:`key`), the same on every rank: written into
        every part and the commit marker, so that a reader never takes parts of two saves for
        one checkpoint."""
        return hashlib.sha1(f"{self._nonce}/{key}".encode()).hexdigest()[:16]

    def put(self, report: Report) -> None:
        self._queue.put(report)

    def abandon(self, keys: Iterable[str], reason: str) -> None:
        """Fail the rounds at ``keys`` on every rank unless they are decided already."""
        store = self.link.client()  # the thread's client may be held by a wait
        for key in keys:
            try:
                CommitRound(store, key, rank=self.rank, world_size=self.world_size).abandon(reason)
            except Exception as exc:  # the store is gone: the round fails on its own
                logger.info("could not abandon the commit at %s: %s", key, exc)

    def close(self) -> None:
        """Finish the reports queued so far, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            report = self._queue.get()
            if report is None:
                return
            outcome = self._commit(report)
            if report.file is None or report.done is None:
                continue  # this rank already knows (save() raised or returned None)
            if isinstance(outcome, str):
                report.done({self.rank: outcome})
                continue
            if outcome.failed and report.error is None:
                with contextlib.suppress(OSError):  # decided "failed": leave no part behind
                    os.unlink(report.file)
            report.done(dict(outcome.causes))

    def _commit(self, report: Report) -> Outcome | str:
        """One round; a description of the failure when the store failed (then nothing is
        known about the outcome: the part stays)."""
        round_ = CommitRound(self._store, report.key, rank=self.rank, world_size=self.world_size)
        marker = _Marker(
            report.directory or report.path,
            {"world_size": self.world_size, "format": report.format, "save_id": report.save_id},
        )
        then = report.then

        def act() -> None:
            marker.act()
            if then is not None:
                then()

        try:
            outcome = round_.report(
                report.error, prepare=marker.prepare, act=act, discard=marker.discard
            )
            if outcome is None:
                outcome = round_.wait(self.timeout)
            round_.close()
            return outcome
        except Exception as exc:
            logger.warning("commit of %s: the store failed: %s", report.path, exc)
            return f"store failed during commit: {exc}"
