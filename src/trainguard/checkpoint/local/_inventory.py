"""What each rank holds under its local root, and the answers every rank computes alike.

Layout of a local root (ranks of one node may share it)::

    ROOT/iter_000000000120/owner00003.h00001.safetensors
         iteration 120, the part of owner rank 3, the copy that holder rank 1 wrote

Iterations are zero-padded to 12 digits and written in full beyond (``iter_1000000000000``),
up to :data:`MAX_ITERATION`; a directory counts only under the exact name its number gets, so
every name the scan accepts is the one :func:`iteration_dir` writes. Only directories and
regular files count (never symlinks, FIFOs or devices, which are never opened).

A part is named by the iteration and its *owner*: the rank number that saved it. The holder
number only keeps two copies in one shared root apart. ``.tmp`` files are never counted.

:func:`scan` lists the parts of a root and verifies their checksums (remembering files it has
already verified, by inode, size and modification time). :func:`agree` and :func:`plan` are pure
functions of every rank's report: every rank computes the same result from the same reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import re
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from trainguard.checkpoint.format.read import parse_header, verify_data
from trainguard.checkpoint.local import _root
from trainguard.errors import CheckpointCorruptError, CheckpointError, ConfigError

logger = logging.getLogger(__name__)

#: The largest iteration a local checkpoint can have (the largest signed 64-bit integer).
MAX_ITERATION = 2**63 - 1


def check_iteration(iteration: object) -> None:
    """Raise :class:`ConfigError` for an iteration number that a save cannot store."""
    if (
        isinstance(iteration, bool)
        or not isinstance(iteration, int)
        or not 0 <= iteration <= MAX_ITERATION
    ):
        raise ConfigError(
            f"iteration={iteration!r}: use an integer from 0 to 2**63 - 1 ({MAX_ITERATION}); a "
            "larger count can be scaled down or kept in the state"
        )


_DIR = re.compile(r"^iter_(\d{12,19})$")
_FILE = re.compile(r"^owner(\d{5})\.h(\d{5})\.safetensors$")


def _dir_name(iteration: int) -> str:
    return f"iter_{iteration:012d}"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, _dir_name(iteration))


def part_path(root: str, iteration: int, owner: int, holder: int) -> str:
    return os.path.join(
        iteration_dir(root, iteration), f"owner{owner:05d}.h{holder:05d}.safetensors"
    )


@dataclasses.dataclass(frozen=True)
class Part:
    """One verified copy of a part on this rank's root."""

    iteration: int
    owner: int
    world_size: int  # of the world that saved it
    replication: str
    path: str
    file_size: int

    def report(self) -> list[Any]:
        return [self.iteration, self.owner, self.world_size, self.replication, self.file_size]


class Inventory:
    """Scans one root; remembers verified files so a second scan hashes only what changed."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._verified: dict[str, tuple[int, int, int]] = {}
        #: ``[iteration, owner]`` of the part files the latest scan found but could not verify
        self.unreadable: list[list[int]] = []

    def trust(self, path: str) -> None:
        """Record a file this process has just written (its checksums came from the data)."""
        with contextlib.suppress(OSError):
            self._verified[path] = _identity(path)

    def iterations(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = _DIR.match(name)
            if m is None:
                continue
            iteration = int(m.group(1))
            if iteration > MAX_ITERATION or name != _dir_name(iteration):
                continue  # not a name this library writes (e.g. iter_0000000000005)
            if _root.is_directory(os.path.join(self.root, name)):
                found.append(iteration)
        return sorted(found)

    def distrust(self, path: str) -> None:
        """Hash ``path`` again at the next scan."""
        self._verified.pop(path, None)

    def distrust_failed(
        self, failed: Iterable[Sequence[int]], mine: Mapping[int, Part], rank: int, attempt: int
    ) -> None:
        """After load attempt ``attempt`` (from 0), whose copies ``[owner, holder]`` failed
        their checksums: ``rank``'s own failed copies (of ``mine``) are hashed again at the
        next scan, which drops them if they are bad."""
        failed = [list(pair) for pair in failed]
        for owner, holder in failed:
            if holder == rank and owner in mine:
                self.distrust(mine[owner].path)
        logger.warning("load attempt %d: bad copies %s; trying again", attempt + 1, failed)

    def scan(self, *, fresh: Iterable[tuple[int, int]] = ()) -> list[Part]:
        """Every part under the root that verifies; parts ``(iteration, owner)`` in ``fresh``
        are hashed again even if unchanged since they were last verified."""
        fresh = set(fresh)
        parts: list[Part] = []
        self.unreadable = []
        for iteration in self.iterations():
            directory = iteration_dir(self.root, iteration)
            try:
                names = sorted(os.listdir(directory))
            except OSError:  # removed meanwhile, or not a directory
                continue
            for name in names:
                m = _FILE.match(name)
                if not m:
                    continue
                path = os.path.join(directory, name)
                owner = int(m.group(1))
                part = self._check(path, iteration, owner, (iteration, owner) in fresh)
                if part is not None:
                    parts.append(part)
                else:
                    self.unreadable.append([iteration, owner])
        return parts

    def _check(self, path: str, iteration: int, owner: int, fresh: bool) -> Part | None:
        try:
            with _open_part(path) as (ident, mm):
                header = parse_header(mm, path)
                meta = header.metadata
                if (
                    int(meta.get("owner", -1)) != owner
                    or int(meta.get("iteration", -1)) != iteration
                ):
                    raise CheckpointCorruptError(f"{path}: its header names another part")
                if fresh or self._verified.get(path) != ident:
                    if not header.is_trainguard:
                        raise CheckpointCorruptError(f"{path}: not a trainguard file")
                    verify_data(header, mm)
                    self._verified[path] = ident
        except (OSError, CheckpointError, ValueError) as exc:
            self._verified.pop(path, None)
            logger.warning("skipping the copy %s: %s", path, exc)
            return None
        return Part(
            iteration,
            owner,
            int(meta.get("world_size", 0)),
            meta.get("replication", ""),
            path,
            header.file_size,
        )

    def remove_older(self, keep_from: int) -> list[int]:
        """Remove every iteration directory older than ``keep_from``; returns those removed."""
        removed = []
        for iteration in self.iterations():
            if iteration < keep_from:
                shutil.rmtree(iteration_dir(self.root, iteration), ignore_errors=True)
                self._forget(iteration)
                removed.append(iteration)
        return removed

    def remove_newer(self, than: int | None, *, keep: Iterable[int] = ()) -> list[int]:
        """Remove every iteration directory newer than ``than`` (all when None) but those in
        ``keep``."""
        keep = set(keep)
        removed = []
        for iteration in self.iterations():
            if (than is None or iteration > than) and iteration not in keep:
                shutil.rmtree(iteration_dir(self.root, iteration), ignore_errors=True)
                self._forget(iteration)
                removed.append(iteration)
        return removed

    def remove(self, iteration: int) -> bool:
        """Remove one iteration directory; whether it existed."""
        if iteration not in self.iterations():
            return False
        shutil.rmtree(iteration_dir(self.root, iteration), ignore_errors=True)
        self._forget(iteration)
        return True

    def _forget(self, iteration: int) -> None:
        prefix = iteration_dir(self.root, iteration) + os.sep
        for path in [p for p in self._verified if p.startswith(prefix)]:
            del self._verified[path]


def _identity(path: str) -> tuple[int, int, int]:
    return _key(os.lstat(path))


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def _open_part(path: str) -> Iterator[tuple[tuple[int, int, int], mmap.mmap]]:
    """``path`` mapped read-only, with its identity; opened without following a symlink and
    without blocking, and refused unless it is a regular file (a FIFO or device named like a
    part is never read: it could block the scan, or never end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{path}: not a regular file")
        if st.st_size == 0:
            raise CheckpointCorruptError(f"{path}: empty")
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        yield _key(st), mm
    finally:
        mm.close()


# --------------------------------------------------------------------------- agreement


@dataclasses.dataclass(frozen=True)
class Choice:
    """What every rank agrees on for one iteration."""

    iteration: int
    saved_world: int
    replication: str
    holders: dict[int, list[int]]  # owner -> ranks holding a verified copy, in rank order
    sizes: dict[int, int]  # owner -> file size

    def orphans(self, world_size: int) -> list[int]:
        """Owners whose part nobody in a world of ``world_size`` loads (the world shrank)."""
        return list(range(world_size, self.saved_world))


def holdings(reports: Mapping[int, Sequence[Sequence[Any]]]) -> dict[int, dict[str, Any]]:
    """Merge reports (rank -> parts) into iteration -> {holders, sizes, worlds, replications}."""
    merged: dict[int, dict[str, Any]] = {}
    for rank in sorted(reports):
        for iteration, owner, world, replication, size in reports[rank]:
            entry = merged.setdefault(
                int(iteration), {"holders": {}, "sizes": {}, "worlds": set(), "repl": set()}
            )
            holders = entry["holders"].setdefault(int(owner), [])
            if rank not in holders:
                holders.append(rank)
            entry["sizes"][int(owner)] = int(size)
            entry["worlds"].add(int(world))
            entry["repl"].add(str(replication))
    return merged


def missing_owners(entry: Mapping[str, Any], world_size: int) -> list[int]:
    saved = max(entry["worlds"])
    return [o for o in range(min(world_size, saved)) if o not in entry["holders"]]


def whole(
    merged: Mapping[int, Mapping[str, Any]],
    unreadable: Mapping[int, Sequence[Sequence[int]]],
    world_size: int,
    newer_than: int,
) -> list[int]:
    """Iterations newer than ``newer_than`` that nothing shows to be unfinished: every owner
    that a rank loads has a file on some rank, verified or not (``unreadable``: rank ->
    ``[iteration, owner]`` of files that failed to verify). Complete ones, and complete ones
    a read error hides; an iteration none of whose files verifies counts too (its world is
    unknown). A save that never finished lacks some owner's file: a part appears only once
    written whole."""
    present = {(int(it), int(o)) for pairs in unreadable.values() for it, o in pairs}
    found = set(merged) | {it for it, _ in present}
    return sorted(
        it
        for it in found
        if it > newer_than
        and (
            it not in merged
            or all((it, o) in present for o in missing_owners(merged[it], world_size))
        )
    )


def complete(merged: Mapping[int, Mapping[str, Any]], world_size: int) -> list[int]:
    """Iterations, newest first, of which every owner that a rank loads is held somewhere."""
    return sorted(
        (it for it, entry in merged.items() if not missing_owners(entry, world_size)),
        reverse=True,
    )


def choice(merged: Mapping[int, Mapping[str, Any]], iteration: int) -> Choice:
    entry = merged[iteration]
    return Choice(
        iteration,
        max(entry["worlds"]),
        sorted(entry["repl"])[0],
        {o: sorted(h) for o, h in entry["holders"].items()},
        dict(entry["sizes"]),
    )


def plan(chosen: Choice, world_size: int) -> list[tuple[int, int, int]]:
    """Transfers ``(owner, source, destination)`` for the owners whose rank lacks its part.

    Rank ``o`` loads owner ``o``'s part. A rank that holds it reads its own copy; otherwise the
    holder with the fewest transfers so far sends it (ties: the lowest rank).
    """
    load: dict[int, int] = {}
    out = []
    for owner in range(min(world_size, chosen.saved_world)):
        holders = chosen.holders[owner]
        if owner in holders:
            continue
        source = min(holders, key=lambda r: (load.get(r, 0), r))
        load[source] = load.get(source, 0) + 1
        out.append((owner, source, owner))
    return out
