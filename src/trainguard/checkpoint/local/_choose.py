"""Which local iteration to resume from, and what to say about it.

Every rank calls these with the same merged reports (see :func:`._inventory.holdings`), so every
rank makes the same choice; the warnings and events say why an older iteration was chosen, a
replication setting differs, or parts of a larger world go to nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainguard import events
from trainguard.checkpoint.local import _inventory
from trainguard.checkpoint.local.replication import compatible
from trainguard.errors import CheckpointNotFoundError, CheckpointReplicationMismatchError

logger = logging.getLogger(__name__)


def pick(
    merged: Mapping[int, Mapping[str, Any]], iteration: int, *, world_size: int, root: str
) -> _inventory.Choice:
    """``iteration`` if it is complete, else the newest older complete one (with a warning);
    :class:`CheckpointNotFoundError` when there is none."""
    candidates = [it for it in _inventory.complete(merged, world_size) if it <= iteration]
    if not candidates or candidates[0] != iteration:
        reason = (
            f"iteration {iteration} is not on any rank"
            if iteration not in merged
            else f"no rank holds a good copy of the part(s) of owner(s) "
            f"{_inventory.missing_owners(merged[iteration], world_size)} of "
            f"iteration {iteration}"
        )
        if not candidates:
            raise CheckpointNotFoundError(
                f"nothing to load under {root} and its peers: {reason}, and no older "
                "iteration is complete"
            )
        logger.warning("%s; loading iteration %d instead", reason, candidates[0])
        events.emit("local_ckpt_fallback", requested=iteration, loaded=candidates[0], reason=reason)
    return _inventory.choice(merged, candidates[0])


def check_setting(chosen: _inventory.Choice, setting: str, *, allow: bool, root: str) -> None:
    """Raise :class:`CheckpointReplicationMismatchError` when ``chosen`` was saved with another
    replication setting than ``setting`` (see :func:`.replication.compatible`), unless ``allow``."""
    if compatible(chosen.replication, setting) or allow:
        return
    raise CheckpointReplicationMismatchError(
        f"iteration {chosen.iteration} under {root} was saved with "
        f"{chosen.replication} but this manager uses {setting}. Create the manager with "
        "the setting used at save time to resume, pass allow_replication_change=True to "
        "load it anyway (its parts are complete), or start fresh in an empty root"
    )


def note_orphans(chosen: _inventory.Choice, *, world_size: int, rank: int) -> None:
    """Log (on rank 0) and record the owners of ``chosen`` that no rank of this world loads."""
    orphans = chosen.orphans(world_size)
    if orphans and rank == 0:
        logger.warning(
            "iteration %d was saved by %d ranks, this world has %d: the parts of owner(s) "
            "%s go to nobody (unless loaded with load(iteration, into=target), which reads "
            "the chunks of every part)",
            chosen.iteration,
            chosen.saved_world,
            world_size,
            orphans,
        )
    if orphans:
        events.emit(
            "local_ckpt_world_changed",
            iteration=chosen.iteration,
            saved_world=chosen.saved_world,
            world_size=world_size,
            unloaded_owners=orphans,
        )
