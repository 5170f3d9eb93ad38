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
import threading
import time
from typing import Any

from trainguard import events
from trainguard.checkpoint.format.read import load_buffer, load_file, verify_path
from trainguard.checkpoint.local import _inventory, _transfer
from trainguard.checkpoint.local._loading import Loader
from trainguard.checkpoint.local._remembered import Remembered
from trainguard.errors import CheckpointCorruptError

logger = logging.getLogger(__name__)

_ATTEMPTS = 3  # loads in a row whose received copies fail their checksums before giving up


def load_part(
    loader: Loader,
    iteration: int,
    *,
    remembered: Remembered | None,
    seq: int,
    allow_pickle: bool,
    started: float,
) -> Any:
    """This rank's whole part of ``iteration`` (or of an older complete one), every rank
    together; ``remembered``: what the staging buffer holds, ``seq``: the saves of this round,
    ``started``: when the load began (for its event). Sets ``loader.last_load``."""
    fast, loader.memory_round = loader.memory_round, None
    if fast is not None and fast.applies(iteration, loader.gather.calls, seq):
        state, loader.last_load = fast.restore(remembered, loader.restore, allow_pickle, started)
        return state
    for attempt in range(_ATTEMPTS):
        parts = loader.inventory.scan()  # hashes only files changed since last verified
        merged = loader.holdings("load", parts)
        chosen = loader.pick(merged, iteration)
        transfers = _inventory.plan(chosen, loader.world_size)
        mine = {p.owner: p for p in parts if p.iteration == chosen.iteration}
        own = mine.get(loader.rank) if loader.rank < chosen.saved_world else None
        memory = remembered
        if own is None or memory is None or not memory.usable(chosen.iteration, loader.rank):
            memory = None
        # this rank's own copy is hashed again while the transfers run (unless the staging
        # buffer it was written from still holds it: then no file is read)
        check = Background(verify_path, own.path) if own is not None and not memory else None
        paths = {owner: part.path for owner, part in mine.items()}
        plan = (chosen.iteration, chosen.sizes, transfers, paths)
        received = _transfer.move_parts(loader.group(bool(transfers)), *plan, rank=loader.rank)
        state, bad, kind = None, None, "file"
        if received is not None:
            source, raw = received
            try:
                state, _ = load_buffer(
                    raw,
                    f"part of owner {loader.rank} from rank {source}",
                    allow_pickle=allow_pickle,
                )
            except CheckpointCorruptError as exc:  # the sender's copy went bad unseen
                logger.warning("%s", exc)
                bad = [loader.rank, source]
            where, nbytes, kind = f"rank {source}", len(raw), "peer"
        elif memory is not None:
            state = memory.restore(loader.restore, allow_pickle=allow_pickle)
            where, nbytes, kind = "memory", memory.nbytes, "memory"
        elif own is not None and check is not None:
            error = check.result()
            if error is None:
                state, _ = load_file(own.path, verify=False, allow_pickle=allow_pickle)
            else:
                logger.warning("%s", error)
                bad = [loader.rank, loader.rank]
            where, nbytes = f"local {own.path}", own.file_size
        failed = loader.settle([bad] if bad else [], mine, attempt)
        if not failed:
            break
    else:
        raise CheckpointCorruptError(
            f"load of iteration {iteration}: copies kept failing their checksums after "
            f"transfer ({failed}) in {_ATTEMPTS} attempts"
        )
    loader.resumed(chosen.iteration, merged)
    if _absent(loader.rank, chosen):
        return None
    loader.last_load = {"iteration": chosen.iteration, "source": where, "bytes": nbytes}
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


class Background:
    """Run ``fn(*args)`` in a thread; :meth:`result` returns the exception it raised, or None."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=run, name="trainguard-verify", daemon=True)
        self._thread.start()

    def result(self) -> BaseException | None:
        self._thread.join()
        return self._error
