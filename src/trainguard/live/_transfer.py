"""Moving one rank's live state to another over the round's process group, checksummed.

The donor flattens its state (:func:`trainguard.checkpoint.format.layout.flatten`: tensors become
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
build the state (:func:`trainguard.checkpoint.format.layout.unflatten`, which checks every node of a
skeleton nobody vouches for). Checksums are computed by the donor from its live tensors as it
sends them, so a flipped bit anywhere between that moment and the receiver's check is caught.

**Devices.** Every message lives on the group's *wire device* (:func:`wire_device`): the CPU
for gloo, the current CUDA device for NCCL (with both backends in one group: CUDA when the
state holds CUDA tensors). CUDA state then travels over NCCL straight from the live tensors,
never through host memory. The checksum follows the wire device (named in the header):
``xxh3`` (xxh3-64 of each message, on the host) on the CPU, ``words`` on a GPU
(:func:`words_digest`: a keyed, position-dependent mix of the bytes as 64-bit words, summed,
computed by torch on the device so that nothing is copied to the host but one int64 per
message, and checked with one synchronization at the end).
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

__all__ = [
    "CHECKSUMS",
    "CHUNK",
    "PACK",
    "Outgoing",
    "Received",
    "own_bytes",
    "prepare",
    "receive",
    "send",
    "wire_device",
    "words_digest",
]

_MAX_HEADER = 64 << 20  # a header larger than this is refused (a skeleton is kilobytes)
_MAX_ENTRIES = 1 << 20
PACK = 1 << 20  #: entries smaller than this travel together in one message
CHUNK = 16 << 20  #: larger entries travel in messages of at most this many bytes

#: called with (entry name, the bytes about to be sent) on the donor; returns what is sent
#: instead. Only for tests that corrupt a transfer on purpose.
Tamper = Callable[[str, torch.Tensor], torch.Tensor]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


#: the checksums a header may name: ``xxh3`` on the host, ``words`` computed on the device
CHECKSUMS = ("xxh3", "words")
_KEY = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: odd, spreads the positions
_MUL = -4658895280553007687  # 0xBF58476D1CE4E5B9 as an int64: odd, so multiplying is a bijection
_LOW33 = (1 << 33) - 1


def words_digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 checksum of the 1-D ``uint8`` tensor ``t``, computed where ``t`` lives.

    Each 64-bit word ``w`` at position ``i`` becomes ``x = (w ^ key(i)) * M`` followed by a
    logical xorshift (each step a bijection of the word, so a change of one word always changes
    its term); the terms and the length are summed modulo 2**64, which does not depend on the
    order a device reduces in. Bytes past the last whole word count as words of their own."""
    n = t.numel()
    whole = n - n % 8
    words = t[:whole]
    if whole and (words.data_ptr() % 8 or words.storage_offset() % 8):
        words = words.clone()  # an unaligned slice of the pack (under PACK bytes)
    parts = [words.view(torch.int64)] if whole else []
    if whole < n:
        parts.append(t[whole:].to(torch.int64))
    if not parts:
        return torch.tensor(0, dtype=torch.int64, device=t.device)
    w = torch.cat(parts) if len(parts) > 1 else parts[0]
    keys = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=t.device) * _KEY
    x = (w ^ keys) * _MUL
    x = x ^ ((x >> 31) & _LOW33)
    return x.sum() + n


def _digest(t: torch.Tensor, checksum: str = "xxh3") -> Any:
    """``t``'s checksum: an int (``xxh3``, xxh3-64 of its bytes as a signed int64, on the host)
    or a 0-d int64 tensor on ``t``'s device (``words``)."""
    if checksum == "words":
        return words_digest(t)
    value = xxhash.xxh3_64_intdigest(memoryview(t.numpy()))  # type: ignore[arg-type]
    return value - (1 << 64) if value >= 1 << 63 else value


def _as_ints(digests: list[Any]) -> list[int]:
    """Checksums as ints (device ones: one copy to the host for all of them)."""
    if digests and isinstance(digests[0], torch.Tensor):
        return [int(v) for v in torch.stack(digests).tolist()]
    return [int(v) for v in digests]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def wire_device(group: Any, state: Any = None) -> torch.device:
    """The device the messages of a transfer over ``group`` live on: the current CUDA device
    for NCCL, the CPU for gloo (or any other backend); a group with both (``cpu:gloo,cuda:nccl``)
    uses CUDA when ``state`` holds a CUDA tensor. Donor and receiver must agree: both decide
    from their own state, which a job builds on one kind of device."""
    backend = str(dist.get_backend(group)).lower()
    nccl = "nccl" in backend
    gloo = "gloo" in backend or not nccl
    cuda = any(t.is_cuda for t in _tensors(state)) if state is not None else False
    if nccl and (not gloo or cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    checksum: str = "xxh3"  # one of CHECKSUMS


def prepare(
    state: Any, step: int, *, device: torch.device | None = None, checksum: str | None = None
) -> Outgoing:
    """Flatten ``state`` (at ``step``) for sending from ``device`` (the wire device,
    :func:`wire_device`; default the CPU). Entries under :data:`PACK` bytes travel together in
    one message (a copy); the others in chunks of their own, from the live tensors (no copy
    when they are on ``device``). ``checksum``: one of :data:`CHECKSUMS` (default: ``xxh3``
    on the CPU, ``words`` on any other device)."""
    wire = torch.device("cpu") if device is None else torch.device(device)
    checksum = checksum or ("xxh3" if wire.type == "cpu" else "words")
    if checksum not in CHECKSUMS or (checksum == "xxh3" and wire.type != "cpu"):
        raise ValueError(f"checksum={checksum!r} on {wire}: use one of {CHECKSUMS}")
    flat = layout.flatten(state, allow_sharded=False)
    payloads = [_as_bytes(e.source).to(wire) for e in flat.entries]
    small_bytes = [p for p in payloads if p.numel() < PACK]
    pack = torch.cat(small_bytes) if small_bytes else torch.empty(0, dtype=torch.uint8, device=wire)
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
            "checksum": checksum,
        }
    ).encode()
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    meta = torch.tensor([len(header), _digest(head)], dtype=torch.int64)  # on the host: xxh3
    return Outgoing(meta.to(wire), head.to(wire), pack, small, large, order, checksum=checksum)


def send(out: Outgoing, dst: int, *, group: Any = None, tamper: Tamper | None = None) -> list[Any]:
    """Start sending ``out`` to rank ``dst``; returns the works to wait on (the sends to
    several receivers run in parallel). The first call checksums each message after it has
    started sending it, so the checksums overlap the transfer."""
    works = [dist.isend(out.meta, dst, group=group), dist.isend(out.head, dst, group=group)]
    if out.pack.numel():
        works.append(dist.isend(tamper("pack", out.pack) if tamper else out.pack, dst, group=group))
    compute = out.trailer is None
    how = out.checksum
    small = [_digest(out.pack[o : o + n], how) for o, n in out.small] if compute else []
    large: list[list[Any]] = []
    for name, data in out.large:
        digests = []
        for chunk in _chunks(data, CHUNK):
            works.append(dist.isend(tamper(name, chunk) if tamper else chunk, dst, group=group))
            if compute:
                digests.append(_digest(chunk, how))
        large.append(digests)
    if out.trailer is None:
        values: list[Any] = []
        it = iter(small)
        for where in out.order:
            values += [next(it)] if where < 0 else large[where]
        if how == "words":  # device tensors: stacked where they are, no copy to the host
            empty = torch.empty(0, dtype=torch.int64, device=out.pack.device)
            out.trailer = torch.stack(values) if values else empty
        else:
            out.trailer = torch.tensor(values, dtype=torch.int64, device=out.pack.device)
    works.append(dist.isend(out.trailer, dst, group=group))
    return works


@dataclasses.dataclass
class Received:
    """What :func:`receive` got: the state (None when a check failed), why not, and size."""

    state: Any
    problem: str | None
    nbytes: int


def _header(src: int, group: Any, wire: torch.device) -> dict[str, Any]:
    meta = torch.empty(2, dtype=torch.int64, device=wire)
    dist.recv(meta, src, group=group)
    length, want = (int(v) for v in meta.tolist())
    if not 0 < length <= _MAX_HEADER:
        raise CheckpointCorruptError(f"live state from rank {src}: header of {length} bytes")
    head = torch.empty(length, dtype=torch.uint8, device=wire)
    dist.recv(head, src, group=group)
    head = head.cpu()
    if _digest(head) != want:
        # the sizes that follow cannot be trusted: the round cannot stay in step with this
        # donor, so the whole round ends (the next round falls back or picks another donor)
        raise CheckpointCorruptError(f"live state from rank {src}: the header failed its checksum")
    header = json.loads(head.numpy().tobytes())
    entries, pack, chunk = header.get("entries"), header.get("pack"), header.get("chunk")
    ok = isinstance(entries, list) and len(entries) <= _MAX_ENTRIES and isinstance(pack, int)
    ok = ok and isinstance(chunk, int) and chunk > 0
    how = header.setdefault("checksum", "xxh3")
    ok = ok and how in CHECKSUMS and (how == "words" or wire.type == "cpu")
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
    src: int,
    step: int,
    *,
    group: Any = None,
    into: dict[str, torch.Tensor] | None = None,
    device: torch.device | None = None,
    ready: Callable[[], None] | None = None,
) -> Received:
    """Receive a state that rank ``src`` sends with :func:`send` and check it; ``step`` is the
    step the round agreed on (the donor must be at it). ``into``: entry name -> this rank's
    own bytes (1-D ``uint8`` views of its live tensors) that a large entry of the same size is
    received into, in place, saving a copy (this rank's state is being replaced anyway; on a
    failed check the caller takes another donor or loads a checkpoint); only those on
    ``device`` (the wire device the donor prepared for; default the CPU) are. Every receive is
    posted at once; each chunk is checksummed while the next ones arrive. ``ready`` is called
    once the header arrived, before anything is received into ``into``."""
    wire = torch.device("cpu") if device is None else torch.device(device)
    header = _header(src, group, wire)
    if ready is not None:
        ready()
    how = header["checksum"]
    pack = torch.empty(header["pack"], dtype=torch.uint8, device=wire)
    pack_work = _irecv(pack, src, group) if pack.numel() else None
    data: dict[str, torch.Tensor] = {}
    sums: dict[str, list[Any]] = {}  # entry name -> the checksums of its bytes, in order
    chunks: list[tuple[str, torch.Tensor, Any]] = []  # (entry name, view, its receive)
    total = pack.numel()
    for name, nbytes, where in header["entries"]:
        name = str(name)
        sums[name] = []
        if where >= 0:
            data[name] = pack[where : where + nbytes]
            continue
        own = (into or {}).get(name)
        fits = own is not None and own.numel() == nbytes and own.device == wire
        buf = (
            own if fits and own is not None else torch.empty(nbytes, dtype=torch.uint8, device=wire)
        )
        data[name] = buf
        chunks += [(name, v, _irecv(v, src, group)) for v in _chunks(buf, header["chunk"])]
        total += nbytes
    count = len(chunks) + sum(1 for *_, where in header["entries"] if where >= 0)
    trailer = torch.empty(count, dtype=torch.int64, device=wire)
    trailer_work = _irecv(trailer, src, group)
    if pack_work is not None:
        pack_work.wait()
    for name, _, where in header["entries"]:
        if where >= 0:
            sums[str(name)].append(_digest(data[str(name)], how))
    for name, view, work in chunks:
        work.wait()
        sums[name].append(_digest(view, how))
    trailer_work.wait()
    flat = _as_ints([d for got in sums.values() for d in got])  # one copy to the host
    want, mine, problem = iter(trailer.tolist()), iter(flat), None
    for name, got in sums.items():
        if [next(want) for _ in got] != [next(mine) for _ in got]:
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
