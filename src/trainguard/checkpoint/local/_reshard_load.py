"""``LocalCheckpointManager.load(iteration, into=target)``: fill a target state of any sharding.

Parts are named by owner (the rank number at save time); every owner's part is held by its owner
and its clique peers. A sharded state (DTensors) is spread over every part, so a rank of a world
of another size (fewer ranks after a shrink, more after growing back) needs chunks of several
parts. Every rank calls :func:`load_into` together; each attempt runs these steps::

    1. inventory   every rank reports the parts it holds (verified); all pick the same iteration,
                   the newest <= the one asked for of which EVERY owner's part is held somewhere
    2. headers     the lowest-numbered holder of each part publishes its header through the
                   store; every rank builds the same Index of saved chunks
    3. needs       each rank computes the chunks overlapping its target; it reads those of parts
                   it holds itself (read_range + checksum) and publishes the byte ranges it lacks
    4. transfers   every rank computes the same plan from the published needs (ranks, then
                   ranges in order; each range from the holder sent the fewest bytes so far,
                   ties: the lowest rank) and runs its share as one batch on the manager's
                   channel; each received range is checked against its checksum
    5. outcome     every rank reports the copies that failed; if any did, their holders hash
                   them again and every rank starts over (a bad copy drops out of the holders,
                   so another holder, or an older complete iteration, is used next)

The index's cover is checked right after step 2 (overlapping chunks or a region no chunk
holds, in any sharded tensor: :class:`CheckpointCorruptError` on every rank, before anything is
read). Only then is the target filled in place (:func:`trainguard.checkpoint._reshard.fill`):
a failed attempt leaves it untouched.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard import events
from trainguard.checkpoint._reshard import Index, SavedChunk, check_chunk, fill
from trainguard.checkpoint.format.read import (
    FileHeader,
    header_bytes,
    parse_header_bytes,
    read_range,
)
from trainguard.checkpoint.local import _choose, _inventory, _transfer
from trainguard.checkpoint.local._loading import Loader
from trainguard.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)

_ATTEMPTS = 3  # as for the manager's load: attempts whose copies fail their checksums
_EVERY_OWNER = sys.maxsize  # a world size that asks for every owner's part (see _pick)

Range = tuple[int, int, int]  # (part, begin, end): a byte range of one part's file


@dataclasses.dataclass
class _Fetched:
    """What one attempt gathered: verified bytes per range, and the copies that failed."""

    data: dict[Range, bytes | bytearray] = dataclasses.field(default_factory=dict)
    local: int = 0  # bytes read from this rank's own copies
    received: int = 0  # bytes received from peers
    sources: set[int] = dataclasses.field(default_factory=set)  # ranks that sent some
    bad: list[list[int]] = dataclasses.field(default_factory=list)  # [part, holder]


def load_into(
    loader: Loader,
    iteration: int,
    into: Any,
    *,
    allow_pickle: bool,
    started: float,
) -> Any:
    """Fill ``into`` in place from ``iteration`` (or an older complete one) and return it.

    Every rank of the manager's world calls it together (see the module's docstring);
    ``started``: when the load began (``time.monotonic()``), for its event. Sets the loader's
    ``last_load``.
    """
    for attempt in range(_ATTEMPTS):
        parts = loader.inventory.scan()
        merged = loader.holdings("load", parts)
        chosen = _pick(loader, merged, iteration)
        mine = {p.owner: p for p in parts if p.iteration == chosen.iteration}
        index = Index.from_headers(_headers(loader, chosen, mine))
        # every rank built the same index, so every rank refuses alike, before anything is read
        index.refuse_bad_cover(f"{loader.root}: iteration {chosen.iteration}")
        plain = loader.rank if loader.rank < chosen.saved_world else 0
        needed = _ranges(index.needed(into, plain_part=plain))
        fetched = _fetch(loader, chosen, needed, mine)
        failed = loader.settle(fetched.bad, mine, attempt)
        if not failed:
            break
    else:
        raise CheckpointCorruptError(
            f"load of iteration {iteration} into the target: copies kept failing their "
            f"checksums ([part, holder]: {failed}) in {_ATTEMPTS} attempts"
        )
    stats = fill(
        into,
        index,
        lambda c: fetched.data[_key(c)],
        plain_part=plain,
        allow_pickle=allow_pickle,
    )
    loader.resumed(chosen.iteration, merged)
    last = loader.last_load = {
        "iteration": chosen.iteration,
        "source": _describe(fetched),
        "bytes": fetched.local + fetched.received,
        "bytes_local": fetched.local,
        "bytes_received": fetched.received,
        "chunks": stats.chunks_read,
        "parts": sorted(stats.parts_read),
    }
    elapsed = time.monotonic() - started
    extra = {"requested": iteration, "saved_world": chosen.saved_world, "attempts": attempt + 1}
    fields = {**last, **extra, "copy": last["source"]}
    fields["source"] = "peer" if fetched.received else "file"  # "memory" is for whole parts
    events.emit("local_ckpt_load", duration=elapsed, **fields)
    return into


def _pick(loader: Loader, merged: dict[int, dict[str, Any]], iteration: int) -> _inventory.Choice:
    """``iteration``, or the newest older one, of which every owner's part is held by a live
    rank: a sharded state has chunks in every part, whatever the world size now."""
    chosen = _choose.pick(merged, iteration, world_size=_EVERY_OWNER, root=loader.root)
    loader.check_setting(chosen)
    return chosen


def _headers(
    loader: Loader, chosen: _inventory.Choice, mine: Mapping[int, _inventory.Part]
) -> dict[int, FileHeader]:
    """Every part's header, published by its lowest-numbered holder (compressed, in one
    gather); parsed alike on every rank."""
    published: dict[str, str] = {}
    for owner, holders in sorted(chosen.holders.items()):
        if holders[0] != loader.rank:
            continue
        try:
            raw = header_bytes(mine[owner].path)
        except (OSError, CheckpointError) as exc:  # gone since the scan: every rank raises below
            logger.warning("cannot read the header of %s: %s", mine[owner].path, exc)
            continue
        published[str(owner)] = base64.b64encode(zlib.compress(raw)).decode()
    out: dict[int, FileHeader] = {}
    for rank, value in sorted(loader.gather("headers", published).items()):
        for owner, text in value.items():
            raw = zlib.decompress(base64.b64decode(text))
            label = f"part of owner {owner} of iteration {chosen.iteration} (from rank {rank})"
            out[int(owner)] = parse_header_bytes(raw, label, chosen.sizes[int(owner)])
    missing = sorted(set(chosen.holders) - set(out))
    if missing:  # every rank gathered the same values: every rank raises alike
        raise CheckpointError(
            f"iteration {chosen.iteration}: the header of part(s) {missing} could not be read "
            "by the rank(s) holding them (see their log); load again"
        )
    return out


def _key(chunk: SavedChunk) -> Range:
    return chunk.part, chunk.begin, chunk.end


def _ranges(chunks: Sequence[SavedChunk]) -> dict[Range, SavedChunk]:
    """The distinct byte ranges of ``chunks`` (plain tensors may share one entry), in order."""
    out: dict[Range, SavedChunk] = {}
    for chunk in sorted(chunks, key=_key):
        out.setdefault(_key(chunk), chunk)
    return out


def _fetch(
    loader: Loader,
    chosen: _inventory.Choice,
    needed: Mapping[Range, SavedChunk],
    mine: Mapping[int, _inventory.Part],
) -> _Fetched:
    """Read the ranges of parts this rank holds, receive the others (every rank together)."""
    fetched = _Fetched()
    wanted = [list(r) for r in needed if r[0] not in mine]
    for r, chunk in needed.items():
        if r[0] in mine:
            data = _read_local(mine[r[0]].path, chunk)
            if data is None:
                fetched.bad.append([r[0], loader.rank])
            else:
                fetched.data[r] = data
                fetched.local += len(data)
    needs = loader.gather("needs", wanted)
    plan = plan_ranges({int(k): v for k, v in needs.items()}, chosen.holders)
    paths = {owner: part.path for owner, part in mine.items()}
    got = _transfer.move_ranges(
        loader.group(bool(plan)), chosen.iteration, plan, paths, rank=loader.rank
    )
    for i, (source, buf) in got.items():
        part, begin, end, _, _ = plan[i]
        try:
            check_chunk(
                needed[(part, begin, end)], buf, f"the copy of part {part} on rank {source}"
            )
        except CheckpointCorruptError as exc:
            logger.warning("%s; another copy is tried", exc)
            fetched.bad.append([part, source])
            continue
        fetched.data[(part, begin, end)] = buf
        fetched.received += len(buf)
        fetched.sources.add(source)
    return fetched


def plan_ranges(
    needs: Mapping[int, Sequence[Sequence[int]]], holders: Mapping[int, Sequence[int]]
) -> list[tuple[int, int, int, int, int]]:
    """Transfers ``(part, begin, end, source, dest)`` for every rank's needed ranges.

    A pure function of what every rank gathered: ranks in order, each rank's ranges in the
    order it listed them; each range comes from the holder of its part that has been given
    the fewest bytes to send so far (ties: the lowest rank). A rank never sends to itself.
    """
    load: dict[int, int] = {}
    out = []
    for dest in sorted(needs):
        for part, begin, end in needs[dest]:
            candidates = [h for h in holders[part] if h != dest]
            source = min(candidates, key=lambda r: (load.get(r, 0), r))
            load[source] = load.get(source, 0) + (end - begin)
            out.append((part, begin, end, source, dest))
    return out


def _read_local(path: str, chunk: SavedChunk) -> bytearray | None:
    """The chunk's bytes from this rank's copy, checksum verified; None (logged) if bad."""
    try:
        data = read_range(path, chunk.begin, chunk.end)
        check_chunk(chunk, data, path)
    except (OSError, CheckpointError) as exc:
        logger.warning("%s; another copy is tried", exc)
        return None
    return data


def _describe(fetched: _Fetched) -> str:
    """``"local"``, ``"ranks 1, 3"`` or ``"local + ranks 3"``: where the chunks came from."""
    where = ["local"] if fetched.local or not fetched.sources else []
    if fetched.sources:
        where.append("ranks " + ", ".join(str(r) for r in sorted(fetched.sources)))
    return " + ".join(where)
