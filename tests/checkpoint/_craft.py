"""Checkpoint files written and rewritten in the test process (no writer process): valid files
for the fuzz tests, and hand-crafted malformed ones for the hostile-file tests."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.write import ALIGN, checksum, encode_header, place


def file_bytes(state: Any, *, pickle: bool = False) -> bytes:
    """The bytes of the trainguard file ``save`` writes for ``state``."""
    flat = flatten(state, pickle=pickle)
    placed, nbytes = place(flat.entries)
    data = bytearray(nbytes)
    by_name = {e.name: e for e in flat.entries}
    for p in placed:
        if p.nbytes:
            dst = torch.frombuffer(data, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
            dst.copy_(raw_bytes(by_name[p.name].source))
    sums = {p.name: checksum(data[p.offset : p.offset + p.nbytes]) for p in placed}
    meta = {"rank": "0", "world_size": "1", "skeleton": json.dumps(flat.skeleton)}
    return encode_header(placed, meta, sums) + bytes(data)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in order, as a fresh 1-D ``uint8`` tensor."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())
    return dense.reshape(-1).view(torch.uint8)


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """A file's header (decoded) and its data section."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: Any, data: bytes, *, body: bytes | None = None) -> bytes:
    """A file from a header (any JSON value, or raw ``body`` bytes) and a data section."""
    if body is None:
        body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % ALIGN)
    return struct.pack("<Q", len(body)) + body + data


def with_skeleton(header: dict[str, Any], skeleton: Any) -> dict[str, Any]:
    """``header`` holding ``skeleton`` (JSON value or text) with a matching checksum."""
    text = skeleton if isinstance(skeleton, str) else json.dumps(skeleton)
    meta = dict(
        header["__metadata__"],
        skeleton=text,
        skeleton_checksum=xxhash.xxh3_64_hexdigest(text.encode()),
    )
    return {**header, "__metadata__": meta}


def rewrite(blob: bytes, change: Callable[[dict[str, Any]], Any]) -> bytes:
    """``blob`` with its header replaced by what ``change`` makes of the decoded header (it
    may edit it in place and return None)."""
    header, data = split(blob)
    changed = change(header)
    return join(header if changed is None else changed, data)


def nested(depth: int, leaf: Any = 1) -> Any:
    """A list nested ``depth`` levels deep around ``leaf`` (built without recursion)."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def deep_json(depth: int) -> str:
    """JSON text of lists nested ``depth`` levels deep (too deep for ``json.dumps``)."""
    return "[" * depth + "]" * depth
