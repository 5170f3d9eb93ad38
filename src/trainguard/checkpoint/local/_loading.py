"""The loading side of one round of a :class:`~.manager.LocalCheckpointManager`.

A :class:`Loader` is built with each round's binding, beside the round's
:class:`~._pipeline.SavePipeline`, from what loading uses: the root's inventory, the round's
gathers (:class:`~._binding.RoundGather`), its replication group (built on first need), the
pipeline (which removes iterations) and the buffer a restore from memory copies into. It holds
what one round learns about the iterations: which newer ones a load kept (:mod:`._newer`),
which files the ranks found but could not verify, and whether ``find_latest`` found an
iteration every rank can restore from memory.

Every rank calls its methods together, in the same order. The steps every load attempt takes
are here (:meth:`Loader.holdings`, :meth:`Loader.pick`, :meth:`Loader.settle`,
:meth:`Loader.resumed`); the two ways to load run them: :func:`._part_load.load_part` (this
rank's whole part) and :func:`._reshard_load.load_into` (a target of any sharding), which the
manager calls with its loader.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainguard import events
from trainguard.checkpoint.local import _choose, _inventory, _newer
from trainguard.checkpoint.local._binding import RoundGather
from trainguard.checkpoint.local._pipeline import SavePipeline
from trainguard.checkpoint.local._remembered import (
    MemoryRound,
    Remembered,
    RestoreBuffer,
    in_memory,
)
from trainguard.checkpoint.local._transfer import Channel

__all__ = ["Loader"]


class Loader:
    """One round's loading (see the module docstring). ``rank`` and ``world_size`` are this
    round's; ``setting`` describes the manager's replication, and an iteration saved with
    another one is refused unless ``allow_replication_change``."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        root: str,
        setting: str,
        allow_replication_change: bool,
        inventory: _inventory.Inventory,
        gather: RoundGather,
        channel_for: Callable[[bool], Channel | None],
        pipeline: SavePipeline,
        restore: RestoreBuffer,
    ) -> None:
        self.rank, self.world_size, self.root = rank, world_size, root
        self.setting, self.allow_replication_change = setting, allow_replication_change
        self.inventory = inventory
        self.gather = gather
        self.group = channel_for
        self.pipeline = pipeline
        self.restore = restore
        #: newer than the iteration loaded, kept (see :mod:`._newer`); known alike on every
        #: rank only from this round's load
        self.kept_newer: set[int] = set()
        #: rank -> the ``[iteration, owner]`` files it found but could not verify
        self.unreadable: dict[int, Any] = {}
        #: what ``find_latest`` found that every rank can restore from memory
        self.memory_round: MemoryRound | None = None
        #: what the last load of this round read (see the manager's ``last_load``)
        self.last_load: dict[str, Any] | None = None

    # ------------------------------------------------------------------ the steps of a load

    def holdings(self, what: str, parts: list[_inventory.Part]) -> dict[int, dict[str, Any]]:
        """Every rank's verified parts, merged; :attr:`unreadable` gets the files they found
        but could not verify."""
        value = [[p.report() for p in parts], self.inventory.unreadable]
        values = self.gather(what, value)
        self.unreadable = {r: v[1] for r, v in values.items()}
        return _inventory.holdings({r: v[0] for r, v in values.items()})

    def pick(self, merged: dict[int, dict[str, Any]], iteration: int) -> _inventory.Choice:
        """The iteration to load: ``iteration`` if complete, else the newest older complete."""
        chosen = _choose.pick(merged, iteration, world_size=self.world_size, root=self.root)
        self.accept(chosen)
        return chosen

    def accept(self, chosen: _inventory.Choice) -> None:
        """Check the replication setting of the iteration resumed from; note orphaned parts."""
        self.check_setting(chosen)
        _choose.note_orphans(chosen, world_size=self.world_size, rank=self.rank)

    def check_setting(self, chosen: _inventory.Choice) -> None:
        """Refuse an iteration saved with another replication setting (unless allowed)."""
        _choose.check_setting(
            chosen, self.setting, allow=self.allow_replication_change, root=self.root
        )

    def settle(
        self, bad: list[list[int]], mine: dict[int, _inventory.Part], attempt: int
    ) -> list[list[int]]:
        """Every rank's copies ``[owner, holder]`` that failed in this load attempt (a gather);
        this rank's are hashed again at the next scan, which drops them if bad."""
        failed = [pair for v in self.gather("loaded", bad).values() for pair in v]
        if failed:
            self.inventory.distrust_failed(failed, mine, self.rank, attempt)
        return failed

    def resumed(self, chosen: int, merged: dict[int, dict[str, Any]]) -> None:
        """Every rank resumes from ``chosen``: the newer iterations that can never be complete
        go, the others are kept (:func:`._newer.after_load`)."""
        self.kept_newer = _newer.after_load(
            self.pipeline,
            chosen,
            merged,
            self.unreadable,
            world_size=self.world_size,
            rank=self.rank,
        )

    # ------------------------------------------------------------------ the manager's calls

    def find_latest(self, remembered: Remembered | None, seq: int, started: float) -> int | None:
        """The manager's ``find_latest`` (see there), its pipeline drained; ``remembered``:
        what its staging buffer holds, ``seq``: its saves in this round."""
        parts = self.inventory.scan()
        memory = in_memory(remembered, parts, self.rank)
        reports = [p.report() for p in parts]
        values = self.gather("find", [memory, reports, self.inventory.unreadable])
        merged = _inventory.holdings({r: v[1] for r, v in values.items()})
        self.unreadable = {r: v[2] for r, v in values.items()}
        candidates = _inventory.complete(merged, self.world_size)
        self.pipeline.note_complete(candidates)
        found = candidates[0] if candidates else None
        self.memory_round = MemoryRound.of(values, found, self.world_size, self.gather.calls, seq)
        if found is not None:
            self.accept(_inventory.choice(merged, found))
            self.resumed(found, merged)
        events.emit(
            "local_ckpt_find_latest",
            duration=time.monotonic() - started,
            iteration=found,
            held=len(parts),
            candidates=candidates[:5],
        )
        return found

    def before_save(self, iteration: int) -> None:
        """Before a save of ``iteration``: replace it when it is a kept newer iteration."""
        _newer.before_save(self.pipeline, self.gather, self.kept_newer, iteration)

    def discard_newer(self, iteration: int) -> list[int]:
        """The manager's ``discard_newer`` (see there), its pipeline drained."""
        removed = _newer.discard_newer(self.pipeline, self.gather, iteration)
        self.kept_newer = {k for k in self.kept_newer if k <= iteration}
        return removed
