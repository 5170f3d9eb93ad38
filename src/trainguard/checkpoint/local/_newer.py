"""Iterations newer than the one a load resumed from: which go, which stay, and rolling back.

A load (or ``find_latest``) that resumes from iteration ``C`` removes the newer iterations
whose save never finished: some owner's part has no file on any rank (a part appears only
once written whole), so they can never be complete, and a later save of the same number must
meet no stale copy. A newer iteration that is complete, or whose every part has a file that
merely failed to read this time (a transient read error), is never removed because an older
one was loaded: ``find_latest`` returns it again once it reads. Saving such an iteration
number again replaces it (every rank removes its copies of it, all pass a barrier, then each
writes); :func:`discard_newer` removes every newer iteration, explicitly (a roll back).

Every rank computes the same kept set from the same gathered reports, so every rank takes the
barrier of a replacing save together; it holds for the round of that load (a new round starts
empty: a process that joined it knows nothing of the last one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainguard import events
from trainguard.checkpoint.local import _inventory
from trainguard.checkpoint.local._pipeline import SavePipeline
from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)

#: a round's gather: every rank's value by rank (see :class:`~._binding.RoundGather`)
Gather = Callable[[str, Any], dict[int, Any]]


def after_load(
    pipeline: SavePipeline,
    chosen: int,
    merged: Mapping[int, Mapping[str, Any]],
    unreadable: Mapping[int, Sequence[Sequence[int]]],
    *,
    world_size: int,
    rank: int,
) -> set[int]:
    """Every rank resumes from ``chosen``: remove the newer iterations that can never be
    complete, keep the others; returns those kept."""
    keep = _inventory.whole(merged, unreadable, world_size, chosen)
    removed = pipeline.drop_newer(chosen, keep=keep)
    if removed:
        logger.info("removed iterations %s, newer than %d and never complete", removed, chosen)
        events.emit("local_ckpt_pruned", removed=removed, newer_than=chosen)
    if keep and rank == 0:
        logger.warning(
            "iteration(s) %s, newer than the iteration %d loaded, are kept (complete, or "
            "every part present): find_latest() returns the newest of them once it reads; to "
            "roll back to %d for good, call discard_newer(%d) on every rank",
            keep,
            chosen,
            chosen,
            chosen,
        )
    return set(keep)


def before_save(pipeline: SavePipeline, gather: Gather, kept: set[int], iteration: int) -> None:
    """Before a save of ``iteration``: when it is a kept newer iteration (in ``kept``, which
    loses it), replace it: every rank removes its copies, then all pass a barrier (no rank
    writes the new save before every rank has removed the old one)."""
    if iteration not in kept:
        return
    removed = pipeline.drop(iteration)
    gather("replace", iteration)
    kept.discard(iteration)
    logger.warning("iteration %d is saved again: its earlier copies were removed", iteration)
    events.emit("local_ckpt_pruned", removed=removed, replaced=iteration)


def discard_newer(pipeline: SavePipeline, gather: Gather, iteration: int) -> list[int]:
    """Remove every iteration newer than ``iteration`` on every rank (see the manager's
    ``discard_newer``); returns those removed from this rank's root."""
    values = gather("discard", iteration)  # every rank has drained its saves
    if any(v != iteration for v in values.values()):
        raise ConfigError(
            f"discard_newer: the ranks asked for different iterations {sorted(values.items())};"
            " every rank must pass the same one"
        )
    removed = pipeline.drop_newer(iteration)
    if removed:
        logger.warning("discarded iterations %s, newer than %d", removed, iteration)
        events.emit("local_ckpt_pruned", removed=removed, newer_than=iteration)
    return removed
