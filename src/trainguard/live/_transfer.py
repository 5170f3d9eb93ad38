"""Moving one rank's live state to another over the round's process group, checksummed.

The donor flattens its state (:func:`trainguard.checkpoint.layout.flatten`: tensors become
entries, everything else a JSON skeleton) and sends, point to point:

1. a meta tensor (int64): the header's length and its xxh3-64 checksum;
2. the header (uint8): JSON with the skeleton, the step, and per entry its name, size and
   xxh3-64 checksum of its bytes;
3. each entry's bytes (uint8), in the header's order.

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

__all__ = ["Received", "receive", "send"]

_MAX_HEADER = 64 << 20  # a header larger than this is refused (a skeleton is kilobytes)
_MAX_ENTRIES = 1 << 20

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


def send(
    state: Any, step: int, dst: int, *, group: Any = None, tamper: Tamper | None = None
) -> list[Any]:
    """Start sending ``state`` (at ``step``) to rank ``dst``; returns the works to wait on
    (the sends to several receivers run in parallel)."""
    flat = layout.flatten(state, allow_sharded=False)
    payloads = [_as_bytes(e.source) for e in flat.entries]
    entries = [[e.name, p.numel(), _digest(p)] for e, p in zip(flat.entries, payloads, strict=True)]
    header = json.dumps({"step": step, "skeleton": flat.skeleton, "entries": entries}).encode()
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    meta = torch.tensor([len(header), _signed(xxhash.xxh3_64_hexdigest(header))], dtype=torch.int64)
    works = [dist.isend(meta, dst, group=group), dist.isend(head, dst, group=group)]
    for e, p in zip(flat.entries, payloads, strict=True):
        out = tamper(e.name, p) if tamper is not None else p
        works.append(dist.isend(out, dst, group=group))
    return works


@dataclasses.dataclass
class Received:
    """What :func:`receive` got: the state (None when a check failed), why not, and size."""

    state: Any
    problem: str | None
    nbytes: int


def receive(src: int, step: int, *, group: Any = None) -> Received:
    """Receive a state that rank ``src`` sends with :func:`send` and check it; ``step`` is the
    step the round agreed on (the donor must be at it)."""
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
    entries = header["entries"]
    if not isinstance(entries, list) or len(entries) > _MAX_ENTRIES:
        raise CheckpointCorruptError(f"live state from rank {src}: malformed entry list")
    data: dict[str, torch.Tensor] = {}
    problem: str | None = None
    total = 0
    for name, nbytes, digest in entries:
        buf = torch.empty(int(nbytes), dtype=torch.uint8)
        dist.recv(buf, src, group=group)
        total += buf.numel()
        if problem is None and _digest(buf) != digest:
            problem = f"entry {name!r} from rank {src} failed its checksum"
        data[str(name)] = buf
    if problem is None and header.get("step") != step:
        problem = f"rank {src} sent step {header.get('step')}, the round agreed on {step}"
    if problem is not None:
        return Received(None, problem, total)
    return Received(layout.unflatten(header["skeleton"], data), None, total)
