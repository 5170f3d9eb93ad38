"""Writing a checkpoint file: placing entries, hashing, encoding the header, durable writes.

The file's layout is described in :mod:`.read`, the reading side (parsing, verifying,
loading). Needs no torch: the writer process starts without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

from trainguard.checkpoint.format import tmpfile, validate
from trainguard.checkpoint.format.kinds import MAX_HEADER
from trainguard.errors import CheckpointError

__all__ = [
    "ALIGN",
    "CHUNK",
    "FORMAT",
    "FORMAT_VERSION",
    "PlacedEntry",
    "check_header_fits",
    "checksum",
    "encode_header",
    "fsync_dir",
    "place",
    "write_file",
]

FORMAT = "trainguard"
FORMAT_VERSION = "2"  # "2": the header holds the skeleton's checksum too
ALIGN = 4096
CHUNK = 64 << 20  # bytes per write call (and per hash step)
_PLACEHOLDER = "0" * 16
_HEADER_SLACK = ALIGN + 1024  # padding, and metadata strings that check_header_fits omits


@dataclasses.dataclass(frozen=True)
class PlacedEntry:
    """An entry with its place in the data section (``offset`` counts from the data start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def place(entries: Sequence[Any]) -> tuple[list[PlacedEntry], int]:
    """Assign data offsets to entries (objects with name, dtype, shape, nbytes, align).

    Returns the placed entries in offset order and the data section's size. Staging copies each
    entry to the same offset in its buffer, so the buffer *is* the data section.
    """
    order = sorted(range(len(entries)), key=lambda i: -entries[i].align)
    placed, offset = [], 0
    for i in order:
        e = entries[i]
        placed.append(PlacedEntry(e.name, e.dtype, tuple(e.shape), offset, e.nbytes))
        offset += e.nbytes
    return placed, offset


def checksum(data: Any) -> str:
    """xxh3-64 of a buffer, 16 hex digits (the GIL is released while hashing)."""
    return xxhash.xxh3_64_hexdigest(data)


def encode_header(
    placed: Sequence[PlacedEntry], metadata: dict[str, str], checksums: dict[str, str]
) -> bytes:
    """The header bytes including the 8-byte length, padded so the data starts on ALIGN."""
    meta = dict(metadata)
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, checksum="xxh3_64")
    meta["skeleton_checksum"] = validate.skeleton_checksum(meta.get("skeleton", "null"))
    meta["checksums"] = json.dumps(checksums, separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": meta}
    for e in placed:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    total = 8 + len(body)
    body += b" " * (-total % ALIGN)
    return struct.pack("<Q", len(body)) + body


def check_header_fits(placed: Sequence[PlacedEntry], skeleton: Any) -> None:
    """Refuse (:class:`CheckpointError`) a state whose header a reader would refuse.

    Called by ``save`` in the caller's thread, before anything is staged: the header holds the
    skeleton (every leaf that is not a tensor, as JSON) and one line per entry, and a reader
    accepts at most :data:`.kinds.MAX_HEADER` bytes of it (safetensors' own limit). The
    message names the largest leaf, usually the culprit (``bytes``, a long list).
    """
    text = json.dumps(skeleton, separators=(",", ":"))
    size = len(encode_header(placed, {"skeleton": text}, {e.name: _PLACEHOLDER for e in placed}))
    if size + _HEADER_SLACK <= MAX_HEADER:
        return
    from trainguard.checkpoint.format.layout import largest_leaf

    where, nbytes = largest_leaf(skeleton)
    raise CheckpointError(
        f"the state's header would take {size} bytes, more than the {MAX_HEADER} a reader "
        f"accepts: everything that is not a tensor is stored there as JSON ({len(text)} bytes; "
        f"the largest leaf is {where}, {nbytes} bytes) and {len(placed)} tensor entries; "
        "store large data as tensors (torch.frombuffer(bytearray(data), dtype=torch.uint8)), "
        "or split the state"
    )


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems (tmpfs on old kernels) refuse: nothing to lose
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _check_space(fd: int, nbytes: int, path: str) -> None:
    """Fail at once with ENOSPC when the file system cannot hold ``nbytes`` more (cheaper than
    ``fallocate``, which on tmpfs zeroes every page before the data is written over it)."""
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_file(
    path: str,
    data: memoryview,
    placed: Sequence[PlacedEntry],
    metadata: dict[str, str],
    *,
    fsync: bool = True,
    hasher: concurrent.futures.Executor | None = None,
) -> int:
    """Write a checkpoint file durably and atomically; returns the file's size.

    ``data`` is the data section (placed entries at their offsets), typically a view of a
    staging buffer in shared memory: it is written straight from there, in large chunks, while
    another thread hashes the chunk just written. The file appears under ``path`` only complete:
    it is written as a new temporary file (see :mod:`.tmpfile`), fsynced, renamed, and the
    directory fsynced. On any error the partial temporary file is removed and the error is
    raised.
    """
    data_nbytes = placed[-1].offset + placed[-1].nbytes if placed else 0
    header = encode_header(placed, metadata, {e.name: _PLACEHOLDER for e in placed})
    fd, tmp = tmpfile.create(path)
    try:
        _check_space(fd, len(header) + data_nbytes, tmp)
        hashes = _write_and_hash(fd, data[:data_nbytes], len(header), placed, hasher)
        final = encode_header(placed, metadata, hashes)
        if len(final) != len(header):
            raise AssertionError("header size changed after hashing")
        _pwrite_all(fd, memoryview(final), 0)
        if fsync:
            os.fsync(fd)
        tmpfile.publish(fd, tmp, path)
    except BaseException:
        os.close(fd)
        tmpfile.discard(tmp)
        raise
    os.close(fd)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return len(header) + data_nbytes


def _write_and_hash(
    fd: int,
    data: memoryview,
    base: int,
    placed: Sequence[PlacedEntry],
    hasher: concurrent.futures.Executor | None,
) -> dict[str, str]:
    states = [xxhash.xxh3_64() for _ in placed]
    cursor = [0]  # first entry not yet fully hashed

    def hash_range(lo: int, hi: int) -> None:
        i = cursor[0]
        while i < len(placed):
            e = placed[i]
            start, end = max(e.offset, lo), min(e.offset + e.nbytes, hi)
            if start < end:
                states[i].update(data[start:end])
            if e.offset + e.nbytes > hi:
                break
            i += 1
        cursor[0] = i

    pending: concurrent.futures.Future[None] | None = None
    for lo in range(0, len(data), CHUNK):
        hi = min(lo + CHUNK, len(data))
        _pwrite_all(fd, data[lo:hi], base + lo)
        if pending is not None:
            pending.result()
        if hasher is not None:
            pending = hasher.submit(hash_range, lo, hi)
        else:
            hash_range(lo, hi)
    if pending is not None:
        pending.result()
    return {e.name: s.hexdigest() for e, s in zip(placed, states, strict=True)}
