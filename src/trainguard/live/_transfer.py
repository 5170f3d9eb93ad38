"""Moving one rank's live state to another over the round's process group, checksummed.

The donor flattens its state (:func:`trainguard.checkpoint.layout.flatten`: tensors become
entries, everything else a JSON skeleton) and sends, point to point:

1. a meta tensor (int64): the header's length and its xxh3-64 checksum;
2. the header (uint8): JSON with the skeleton, the step, the pack's size and per entry its
   name, size, xxh3-64 checksum and offset in the pack (-1: a message of its own);
3. the pack: every entry under :data:`PACK` bytes, concatenated (one message, not dozens);
4. each larger entry's bytes (uint8), in the header's order, straight from the live tensor.

The receiver takes everything the header announces (so both sides stay in step even when
something does not match), then checks the header's and every entry's checksum and the step;
only then does it build the state (:func:`trainguard.checkpoint.layout.unflatten`, which checks
every node of a skeleton nobody vouches for). Checksums are computed by the donor from its
live tensors at the moment it sends, so a flipped bit anywhere between that moment and the
receiver's check is caught.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from trainguard.checkpoint import layout
from trainguard.errors import CheckpointCorruptError

__all__ = ["PACK", "Outgoing", "Received", "own_bytes", "prepare", "receive", "send"]

_MAX_HEADER = 64 << 20  # a header larger than this is refused (a skeleton is kilobytes)
_MAX_ENTRIES = 1 << 20
PACK = 1 << 20  #: entries smaller than this travel together in one message

#: called with (entry name, the bytes about to be sent) on the donor; returns what is sent
#: instead. Only for tests that corrupt a transfer on purpose.
Tamper = Callable[[str, torch.Tensor], torch.Tensor]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(t.numpy()))  # type: ignore[arg-type]


def _signed(hexdigest: str) -> int:
    value = int(hexdigest, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclasses.dataclass
class Outgoing:
    """A donor's state, flattened and checksummed once for all its receivers."""

    meta: torch.Tensor
    head: torch.Tensor
    messages: list[tuple[str, torch.Tensor]]  # ("pack" or an entry's name, its bytes)


def prepare(state: Any, step: int) -> Outgoing:
    """Flatten ``state`` (at ``step``) and checksum every entry. Entries under :data:`PACK`
    bytes travel together in one message (a copy); the others each in their own, from the
    live tensors (no copy)."""
    flat = layout.flatten(state, allow_sharded=False)
    payloads = [_as_bytes(e.source) for e in flat.entries]
    small = [p for p in payloads if p.numel() < PACK]
    pack = torch.cat(small) if small else torch.empty(0, dtype=torch.uint8)
    entries, offset = [], 0
    for e, p in zip(flat.entries, payloads, strict=True):
        where = offset if p.numel() < PACK else -1
        offset += p.numel() if p.numel() < PACK else 0
        entries.append([e.name, p.numel(), _digest(p), where])
    header = json.dumps(
        {"step": step, "skeleton": flat.skeleton, "entries": entries, "pack": pack.numel()}
    ).encode()
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    meta = torch.tensor([len(header), _signed(xxhash.xxh3_64_hexdigest(header))], dtype=torch.int64)
    messages = [("pack", pack)] if pack.numel() else []
    messages += [
        (e.name, p) for e, p in zip(flat.entries, payloads, strict=True) if p.numel() >= PACK
    ]
    return Outgoing(meta, head, messages)


def send(out: Outgoing, dst: int, *, group: Any = None, tamper: Tamper | None = None) -> list[Any]:
    """Start sending ``out`` to rank ``dst``; returns the works to wait on (the sends to
    several receivers run in parallel)."""
    works = [dist.isend(out.meta, dst, group=group), dist.isend(out.head, dst, group=group)]
    for name, data in out.messages:
        works.append(dist.isend(tamper(name, data) if tamper else data, dst, group=group))
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
    raw = head.numpy().tobytes()
    if _signed(xxhash.xxh3_64_hexdigest(raw)) != want:
        # the sizes that follow cannot be trusted: the round cannot stay in step with this
        # donor, so the whole round ends (the next round falls back or picks another donor)
        raise CheckpointCorruptError(f"live state from rank {src}: the header failed its checksum")
    header = json.loads(raw)
    entries, pack = header.get("entries"), header.get("pack")
    ok = isinstance(entries, list) and len(entries) <= _MAX_ENTRIES and isinstance(pack, int)
    for item in entries if ok else []:
        ok = ok and isinstance(item, list) and len(item) == 4
        ok = ok and isinstance(item[1], int) and isinstance(item[3], int) and item[1] >= 0
        ok = ok and (item[3] == -1 or 0 <= item[3] <= pack - item[1])
    if not ok:
        raise CheckpointCorruptError(f"live state from rank {src}: malformed entry list")
    return dict(header)


def receive(
    src: int, step: int, *, group: Any = None, into: dict[str, torch.Tensor] | None = None
) -> Received:
    """Receive a state that rank ``src`` sends with :func:`send` and check it; ``step`` is the
    step the round agreed on (the donor must be at it). ``into``: entry name -> this rank's
    own bytes (1-D ``uint8`` views of its live tensors) that a large entry of the same size is
    received into, in place, saving a copy (this rank's state is being replaced anyway; on a
    failed check the caller takes another donor or loads a checkpoint)."""
    header = _header(src, group)
    pack = torch.empty(header["pack"], dtype=torch.uint8)
    if pack.numel():
        dist.recv(pack, src, group=group)
    data: dict[str, torch.Tensor] = {}
    problem: str | None = None
    total = pack.numel()
    for name, nbytes, digest, where in header["entries"]:
        if where >= 0:
            buf = pack[where : where + nbytes]
        else:
            own = (into or {}).get(name)
            buf = (
                own
                if own is not None and own.numel() == nbytes
                else torch.empty(nbytes, dtype=torch.uint8)
            )
            dist.recv(buf, src, group=group)
            total += nbytes
        if problem is None and _digest(buf) != digest:
            problem = f"entry {name!r} from rank {src} failed its checksum"
        data[str(name)] = buf
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
