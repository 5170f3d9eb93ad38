"""Hot spares: a spare copies the parts it may be asked to take over before it is needed.

A process that waits as a spare (its :class:`~.manager.LocalCheckpointManager` built, but not
bound to any process group yet) runs one thread that, every ``interval`` seconds, looks at the
local roots it was given (``spare_roots``: the roots of other ranks that this process can read,
e.g. the ranks on its own node, or a shared file system) and copies the newest iteration that is
complete there (a verified part of every owner) into its own root, each copy verified. When the
spare then takes over a dead rank ``r``, its own root already holds owner ``r``'s part of that
iteration: its ``find_latest`` reports it and its ``load`` reads it locally, with no transfer.
Older prefetched iterations are removed once a newer one is complete, so the cost is one
iteration's parts of those roots, in the spare's root (RAM when that is ``/dev/shm``).

The thread stops (and is joined) before the manager binds to its first round, and on close.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence

from trainguard import events
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.read import verify_path
from trainguard.checkpoint.local import _inventory, _root

logger = logging.getLogger(__name__)

#: Holder number of a prefetched copy (a holder number only keeps copies apart in one root).
PREFETCHED = 99999
_CHUNK = 8 << 20


class SparePrefetch:
    """The prefetch thread of one spare's manager; see the module docstring."""

    def __init__(
        self, root: str, roots: Sequence[str], interval: float, inventory: _inventory.Inventory
    ) -> None:
        self.root = root
        self.sources = [_inventory.Inventory(r) for r in roots if os.path.abspath(r) != root]
        self.interval = interval
        self._inventory = inventory  # the manager's: copies made here are trusted there
        self.held: int | None = None  # the iteration prefetched last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a copy in progress is abandoned within one chunk) and join it."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.once()
            except Exception as exc:  # a source changing under us: try again next time
                logger.debug("spare prefetch: %s", exc)

    def once(self) -> None:
        """Copy the newest iteration complete under the source roots, if newer than held."""
        newest = self._newest()
        if newest is None or newest[0] == self.held:
            return
        iteration, parts = newest
        started = time.monotonic()
        copied = 0
        _root.prepare_root(self.root)
        _root.make_private_dir(_inventory.iteration_dir(self.root, iteration))
        for owner, source in sorted(parts.items()):
            if self._stop.is_set():
                return
            dest = _inventory.part_path(self.root, iteration, owner, PREFETCHED)
            copied += self._copy(source.path, dest)
        self.held = iteration
        self._inventory.remove_older(iteration)
        events.emit(
            "spare_prefetch",
            duration=time.monotonic() - started,
            bytes=copied,
            iteration=iteration,
            parts=len(parts),
        )

    def _newest(self) -> tuple[int, dict[int, _inventory.Part]] | None:
        """The newest iteration of which the sources hold a verified part of every owner."""
        found: dict[int, dict[int, _inventory.Part]] = {}
        worlds: dict[int, int] = {}
        for source in self.sources:
            for part in source.scan():
                found.setdefault(part.iteration, {}).setdefault(part.owner, part)
                worlds.setdefault(part.iteration, part.world_size)
        for iteration in sorted(found, reverse=True):
            world = worlds[iteration]
            if world > 0 and set(found[iteration]) >= set(range(world)):
                return iteration, {o: found[iteration][o] for o in range(world)}
        return None

    def _copy(self, source: str, dest: str) -> int:
        """Copy ``source`` to ``dest`` (temporary file, verified, renamed); bytes copied."""
        if os.path.exists(dest):
            return 0
        fd, tmp = tmpfile.create(dest)
        try:
            with open(source, "rb") as src, os.fdopen(fd, "wb", closefd=False) as out:
                while chunk := src.read(_CHUNK):
                    if self._stop.is_set():
                        raise InterruptedError("stopped")
                    out.write(chunk)
            verify_path(tmp)
            tmpfile.publish(fd, tmp, dest, mode=_root.PART_MODE)
        except BaseException:
            tmpfile.discard(tmp)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._inventory.trust(dest)
        return os.path.getsize(dest)
