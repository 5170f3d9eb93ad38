"""``LocalCheckpointManager.load(iteration)`` without ``into``: this rank's whole part.

Every rank calls :func:`load_part` together. It restores from the staging buffer when that
still holds this rank's part of the iteration (no file read); otherwise each attempt scans the
root, gathers every rank's holdings, picks the iteration (the one asked for, or the newest
older complete one), moves the parts of ranks that lack theirs from a holder, hashes this
rank's own copy again meanwhile, and has every rank report the copies that failed: those are
hashed again and the attempt repeats, up to :data:`_ATTEMPTS` times.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from trainguard import events
from trainguard.checkpoint.format.read import load_buffer, load_file, verify_path
from trainguard.checkpoint.local import _inventory, _newer, _transfer
from trainguard.checkpoint.local._binding import Background
from trainguard.errors import CheckpointCorruptError

if TYPE_CHECKING:
    from trainguard.checkpoint.local.manager import LocalCheckpointManager

logger = logging.getLogger(__name__)

_ATTEMPTS = 3  # loads in a row whose received copies fail their checksums before giving up


def load_part(
    mgr: LocalCheckpointManager, iteration: int, *, allow_pickle: bool, started: float
) -> Any:
    """This rank's whole part of ``iteration`` (or of an older complete one); every rank
    calls it together. ``started``: when the load began, for its event."""
    fast, mgr._memory_round = mgr._memory_round, None
    if fast is not None and fast.applies(iteration, mgr._calls, mgr._seq):
        state, mgr.last_load = fast.restore(
            mgr._remembered, mgr._res.restore, allow_pickle, started
        )
        return state
    for attempt in range(_ATTEMPTS):
        parts = mgr._inventory.scan()  # hashes only files changed since last verified
        merged = mgr._gather("load", parts)
        chosen = mgr._pick(merged, iteration)
        transfers = _inventory.plan(chosen, mgr.world_size)
        mine = {p.owner: p for p in parts if p.iteration == chosen.iteration}
        own = mine.get(mgr.rank) if mgr.rank < chosen.saved_world else None
        memory = mgr._remembered
        if own is None or memory is None or not memory.usable(chosen.iteration, mgr.rank):
            memory = None
        # this rank's own copy is hashed again while the transfers run (unless the staging
        # buffer it was written from still holds it: then no file is read)
        check = Background(verify_path, own.path) if own is not None and not memory else None
        paths = {owner: part.path for owner, part in mine.items()}
        plan = (chosen.iteration, chosen.sizes, transfers, paths)
        received = _transfer.move_parts(mgr._group(bool(transfers)), *plan, rank=mgr.rank)
        state, bad, kind = None, None, "file"
        if received is not None:
            source, raw = received
            try:
                state, _ = load_buffer(
                    raw,
                    f"part of owner {mgr.rank} from rank {source}",
                    allow_pickle=allow_pickle,
                )
            except CheckpointCorruptError as exc:  # the sender's copy went bad unseen
                logger.warning("%s", exc)
                bad = [mgr.rank, source]
            where, nbytes, kind = f"rank {source}", len(raw), "peer"
        elif memory is not None:
            state = memory.restore(mgr._res.restore, allow_pickle=allow_pickle)
            where, nbytes, kind = "memory", memory.nbytes, "memory"
        elif own is not None and check is not None:
            error = check.result()
            if error is None:
                state, _ = load_file(own.path, verify=False, allow_pickle=allow_pickle)
            else:
                logger.warning("%s", error)
                bad = [mgr.rank, mgr.rank]
            where, nbytes = f"local {own.path}", own.file_size
        failed = mgr._settle([bad] if bad else [], mine, attempt)
        if not failed:
            break
    else:
        raise CheckpointCorruptError(
            f"load of iteration {iteration}: copies kept failing their checksums after "
            f"transfer ({failed}) in {_ATTEMPTS} attempts"
        )
    _newer.after_load(mgr, chosen.iteration, merged, mgr._unreadable)
    if _absent(mgr.rank, chosen):
        return None
    mgr.last_load = {"iteration": chosen.iteration, "source": where, "bytes": nbytes}
    events.emit(
        "local_ckpt_load",
        duration=time.monotonic() - started,
        iteration=chosen.iteration,
        requested=iteration,
        bytes=nbytes,
        source=kind,
        copy=where,
        transfers=len(transfers),
        attempts=attempt + 1,
    )
    return state


def _absent(rank: int, chosen: _inventory.Choice) -> bool:
    """Whether ``rank`` did not exist in the world that saved ``chosen`` (it loads nothing)."""
    if rank < chosen.saved_world:
        return False
    logger.warning(
        "rank %d has no part in iteration %d (saved by %d ranks): nothing to load",
        rank,
        chosen.iteration,
        chosen.saved_world,
    )
    return True
