"""Moving one rank's live state to another over the round's process group, checksummed.

The donor flattens its state (:func:`trainguard.checkpoint.layout.flatten`: tensors become
entries, everything else a JSON skeleton) and sends, point to point:

1. a meta tensor (int64): the header's length and its xxh3-64 checksum;
2. the header (uint8): JSON with the skeleton, the step, the pack's size, the chunk size and per
   entry its name, size and offset in the pack (-1: it travels in chunks of its own);
3. the pack: every entry under :data:`PACK` bytes, concatenated (one message, not dozens);
4. each larger entry's bytes (uint8) in chunks of at most :data:`CHUNK` bytes, in the header's
   order, straight from the live tensor;
5. the trailer (int64): the xxh3-64 checksum of each small entry and of each chunk, in the
   header's order.

The checksums come last so that neither side waits for them: the donor checksums a chunk while
gloo sends it, the receiver posts every receive at once and checksums each chunk while the next
one arrives (a plain send of the same bytes is the baseline the transfer is measured against).

The receiver takes everything the header announces (so both sides stay in step even when
something does not match), then checks every entry's checksums and the step; only then does it
build the state (:func:`trainguard.checkpoint.layout.unflatten`, which checks every node of a
skeleton nobody vouches for). Checksums are computed by the donor from its live tensors as it
sends them, so a flipped bit anywhere between that moment and the receiver's check is caught.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from trainguard.checkpoint.format import layout
from trainguard.errors import CheckpointCorruptError

__all__ = ["CHUNK", "PACK", "Outgoing", "Received", "own_bytes", "prepare", "receive", "send"]

_MAX_HEADER = 64 << 20  # a header larger than this is refused (a skeleton is kilobytes)
_MAX_ENTRIES = 1 << 20
PACK = 1 << 20  #: entries smaller than this travel together in one message
CHUNK = 16 << 20  #: larger entries travel in messages of at most this many bytes

#: called with (entry name, the bytes about to be sent) on the donor; returns what is sent
#: instead. Only for tests that corrupt a transfer on purpose.
Tamper = Callable[[str, torch.Tensor], torch.Tensor]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _digest(t: torch.Tensor) -> int:
    """xxh3-64 of ``t``'s bytes as a signed int64 (what an int64 tensor holds)."""
    value = xxhash.xxh3_64_intdigest(memoryview(t.numpy()))  # type: ignore[arg-type]
    return value - (1 << 64) if value >= 1 << 63 else value


def _chunks(data: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``data`` (1-D) as views of at most ``size`` bytes (one empty view for no bytes)."""
    return list(data.split(size)) if data.numel() else [data]


@dataclasses.dataclass
class Outgoing:
    """A donor's state, flattened once for all its receivers; its checksums are computed by
    the first :func:`send` (while its messages go out) and reused by the others."""

    meta: torch.Tensor
    head: torch.Tensor
    pack: torch.Tensor
    small: list[tuple[int, int]]  # (offset in the pack, size) of each small entry
    large: list[tuple[str, torch.Tensor]]  # (name, bytes) of each larger entry
    order: list[int]  # per entry in the header's order: -1 small, else its index in large
    trailer: torch.Tensor | None = None


def prepare(state: Any, step: int) -> Outgoing:
    """Flatten ``state`` (at ``step``). Entries under :data:`PACK` bytes travel together in
    one message (a copy); the others in chunks of their own, from the live tensors (no copy)."""
    flat = layout.flatten(state, allow_sharded=False)
    payloads = [_as_bytes(e.source) for e in flat.entries]
    small_bytes = [p for p in payloads if p.numel() < PACK]
    pack = torch.cat(small_bytes) if small_bytes else torch.empty(0, dtype=torch.uint8)
    entries: list[list[Any]] = []
    small: list[tuple[int, int]] = []
    large: list[tuple[str, torch.Tensor]] = []
    order: list[int] = []
    offset = 0
    for e, p in zip(flat.entries, payloads, strict=True):
        if p.numel() < PACK:
            entries.append([e.name, p.numel(), offset])
            small.append((offset, p.numel()))
            order.append(-1)
            offset += p.numel()
        else:
            entries.append([e.name, p.numel(), -1])
            order.append(len(large))
            large.append((e.name, p))
    header = json.dumps(
        {
            "step": step,
            "skeleton": flat.skeleton,
            "entries": entries,
            "pack": pack.numel(),
            "chunk": CHUNK,
        }
    ).encode()
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    meta = torch.tensor([len(header), _digest(head)], dtype=torch.int64)
    return Outgoing(meta, head, pack, small, large, order)


def send(out: Outgoing, dst: int, *, group: Any = None, tamper: Tamper | None = None) -> list[Any]:
    """Start sending ``out`` to rank ``dst``; returns the works to wait on (the sends to
    several receivers run in parallel). The first call checksums each message after it has
    started sending it, so the checksums overlap the transfer."""
    works = [dist.isend(out.meta, dst, group=group), dist.isend(out.head, dst, group=group)]
    if out.pack.numel():
        works.append(dist.isend(tamper("pack", out.pack) if tamper else out.pack, dst, group=group))
    compute = out.trailer is None
    small = [_digest(out.pack[o : o + n]) for o, n in out.small] if compute else []
    large: list[list[int]] = []
    for name, data in out.large:
        digests = []
        for chunk in _chunks(data, CHUNK):
            works.append(dist.isend(tamper(name, chunk) if tamper else chunk, dst, group=group))
            if compute:
                digests.append(_digest(chunk))
        large.append(digests)
    if out.trailer is None:
        values, it = [], iter(small)
        for where in out.order:
            values += [next(it)] if where < 0 else large[where]
        out.trailer = torch.tensor(values, dtype=torch.int64)
    works.append(dist.isend(out.trailer, dst, group=group))
    return works


@dataclasses.dataclass
class Received:
    """What :func:`receive` got: the state (None when a check failed), why not, and size."""

    state: Any
    problem: str | None
    nbytes: int


def _header(src: int, group: Any) -> dict[str, Any]:
    meta = torch.empty(2, dtype=torch.int64)
    dist.recv(meta, src, group=group)
    length, want = int(meta[0]), int(meta[1])
    if not 0 < length <= _MAX_HEADER:
        raise CheckpointCorruptError(f"live state from rank {src}: header of {length} bytes")
    head = torch.empty(length, dtype=torch.uint8)
    dist.recv(head, src, group=group)
    if _digest(head) != want:
        # the sizes that follow cannot be trusted: the round cannot stay in step with this
        # donor, so the whole round ends (the next round falls back or picks another donor)
        raise CheckpointCorruptError(f"live state from rank {src}: the header failed its checksum")
    header = json.loads(head.numpy().tobytes())
    entries, pack, chunk = header.get("entries"), header.get("pack"), header.get("chunk")
    ok = isinstance(entries, list) and len(entries) <= _MAX_ENTRIES and isinstance(pack, int)
    ok = ok and isinstance(chunk, int) and chunk > 0
    for item in entries if ok else []:
        ok = ok and isinstance(item, list) and len(item) == 3
        ok = ok and isinstance(item[1], int) and isinstance(item[2], int) and item[1] >= 0
        ok = ok and (item[2] == -1 or 0 <= item[2] <= pack - item[1])
    if not ok:
        raise CheckpointCorruptError(f"live state from rank {src}: malformed entry list")
    return dict(header)


def _irecv(buf: torch.Tensor, src: int, group: Any) -> Any:
    work = dist.irecv(buf, src, group=group)
    assert work is not None  # None only on a rank outside ``group``, which never receives
    return work


def receive(
    src: int, step: int, *, group: Any = None, into: dict[str, torch.Tensor] | None = None
) -> Received:
    """Receive a state that rank ``src`` sends with :func:`send` and check it; ``step`` is the
    step the round agreed on (the donor must be at it). ``into``: entry name -> this rank's
    own bytes (1-D ``uint8`` views of its live tensors) that a large entry of the same size is
    received into, in place, saving a copy (this rank's state is being replaced anyway; on a
    failed check the caller takes another donor or loads a checkpoint). Every receive is
    posted at once; each chunk is checksummed while the next ones arrive."""
    header = _header(src, group)
    pack = torch.empty(header["pack"], dtype=torch.uint8)
    pack_work = _irecv(pack, src, group) if pack.numel() else None
    data: dict[str, torch.Tensor] = {}
    sums: dict[str, list[int]] = {}  # entry name -> the checksums of its bytes, in order
    chunks: list[tuple[str, torch.Tensor, Any]] = []  # (entry name, view, its receive)
    total = pack.numel()
    for name, nbytes, where in header["entries"]:
        name = str(name)
        sums[name] = []
        if where >= 0:
            data[name] = pack[where : where + nbytes]
            continue
        own = (into or {}).get(name)
        buf = (
            own
            if own is not None and own.numel() == nbytes
            else torch.empty(nbytes, dtype=torch.uint8)
        )
        data[name] = buf
        chunks += [(name, v, _irecv(v, src, group)) for v in _chunks(buf, header["chunk"])]
        total += nbytes
    count = len(chunks) + sum(1 for *_, where in header["entries"] if where >= 0)
    trailer = torch.empty(count, dtype=torch.int64)
    trailer_work = _irecv(trailer, src, group)
    if pack_work is not None:
        pack_work.wait()
    for name, _, where in header["entries"]:
        if where >= 0:
            sums[str(name)].append(_digest(data[str(name)]))
    for name, view, work in chunks:
        work.wait()
        sums[name].append(_digest(view))
    trailer_work.wait()
    want, problem = iter(trailer.tolist()), None
    for name, got in sums.items():
        if [next(want) for _ in got] != got:
            problem = f"entry {name!r} from rank {src} failed its checksum"
            break
    if problem is None and header.get("step") != step:
        problem = f"rank {src} sent step {header.get('step')}, the round agreed on {step}"
    if problem is not None:
        return Received(None, problem, total)
    return Received(layout.unflatten(header["skeleton"], data), None, total)


def own_bytes(state: Any) -> dict[str, torch.Tensor]:
    """Entry name -> a writable 1-D ``uint8`` view of each contiguous tensor of ``state`` of
    at least :data:`PACK` bytes (for :func:`receive`'s ``into``)."""
    out = {}
    for e in layout.flatten(state, allow_sharded=False).entries:
        if e.nbytes >= PACK and e.source.is_contiguous():
            out[e.name] = e.source.detach().reshape(-1).view(torch.uint8)
    return out
