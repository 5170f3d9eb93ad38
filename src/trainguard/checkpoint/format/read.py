"""The checkpoint file: a safetensors-compatible container with a checksum per tensor.

Layout (any safetensors reader opens it)::

    u64 little-endian N | N bytes of JSON header, padded with spaces | data
    header = {"__metadata__": {"format": "trainguard", "format_version": "1",
                               "skeleton": "<JSON>", "checksums": "<JSON name -> hex>",
                               "checksum": "xxh3_64", "rank": "0", "world_size": "1"},
              "<entry>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}

- ``8 + N`` is a multiple of :data:`ALIGN` (4096), so the data starts on a page: the file can
  be written and read with direct I/O and mapped with the data page-aligned.
- Entries follow each other without gaps (safetensors requires that), ordered by the largest
  element size that views them, so every tensor starts aligned to its element size.
- Checksums are xxh3-64 of each entry's bytes, as 16 hex digits. The header is written with
  placeholder digits of the same length first, so its size is known before the data is hashed.

Writing lives in :mod:`.write`; this module reads: parsing a header, verifying checksums,
loading. Header parsing and checking need no torch (the writer process starts without it);
:func:`load_file` maps a file and :func:`load_buffer` takes one held in memory (tensors are
views). The header's checks are in :mod:`.validate`; the skeleton is rebuilt by :mod:`.layout`
(imported here only to load).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from trainguard.checkpoint import _regular
from trainguard.checkpoint.format import validate
from trainguard.checkpoint.format.write import FORMAT, checksum
from trainguard.errors import CheckpointCorruptError

__all__ = [
    "FileBytes",
    "FileHeader",
    "check_file",
    "header_bytes",
    "header_of",
    "load_buffer",
    "load_file",
    "open_file",
    "parse_header",
    "parse_header_bytes",
    "read_header",
    "read_range",
    "verify_data",
    "verify_entries",
    "verify_file",
    "verify_path",
]

logger = logging.getLogger(__name__)

#: A whole file held in memory: read, mapped or received.
FileBytes = bytes | bytearray | memoryview | mmap.mmap


@dataclasses.dataclass(frozen=True)
class FileHeader:
    """A parsed header: where the data starts, the entries, and the metadata strings.

    Built only by :func:`read_header`/:func:`parse_header`, which check every field first (see
    :mod:`.validate`): offsets lie inside the file and do not overlap, sizes match shapes.
    """

    path: str
    data_start: int
    file_size: int
    entries: dict[str, tuple[str, list[int], int, int]]  # name -> (dtype, shape, begin, end)
    metadata: dict[str, str]

    @property
    def is_trainguard(self) -> bool:
        return self.metadata.get("format") == FORMAT

    def checksums(self) -> dict[str, str]:  # checked on first use, then kept: do not change
        sums: dict[str, str] | None = self.__dict__.get("_sums")
        if sums is None:  # a frozen dataclass: cached past __setattr__
            sums = validate.check_checksums(self.path, self.metadata, self.entries)
            self.__dict__["_sums"] = sums
        return sums


def _decode_header(label: str, n: int, raw: bytes, size: int) -> FileHeader:
    """Parse the ``n`` bytes of JSON after the length of a file of ``size`` bytes."""
    decoded = validate.decode_json(label, "the header", raw)
    entries, metadata = validate.check_entries(label, decoded, size - 8 - n)
    header = FileHeader(label, 8 + n, size, entries, metadata)
    if header.is_trainguard:
        header.checksums()  # refuse a damaged checksum table before anything is mapped
    return header


def open_file(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path``; with ``dir_fd`` (a checkpoint
    directory opened once), of the entry named ``path``'s last component in that directory.
    The caller closes it."""
    path = os.fspath(path)
    return _regular.open_regular(path if dir_fd is None else os.path.basename(path), dir_fd=dir_fd)


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def header_of(fd: int, label: str) -> FileHeader:
    """:func:`read_header` of the file open as ``fd`` (``label`` names it): read from that very
    descriptor, so that a file replaced under its name meanwhile cannot pair one file's header
    with another's bytes."""
    size = os.fstat(fd).st_size
    n = validate.header_length(label, _pread_all(fd, 8, 0), size)
    raw = _pread_all(fd, n, 8)
    if len(raw) != n:  # the file shrank while we read it
        raise CheckpointCorruptError(f"{label}: truncated: the header is cut short")
    return _decode_header(label, n, raw, size)


def read_header(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> FileHeader:
    """Parse and check a file's header; :class:`CheckpointCorruptError` names what is wrong.
    ``dir_fd``: as for :func:`open_file`."""
    fd = open_file(path, dir_fd=dir_fd)
    try:
        return header_of(fd, os.fspath(path))
    finally:
        os.close(fd)


def header_bytes(path: str | os.PathLike[str]) -> bytes:
    """The raw ``8 + N`` header bytes of a file (to send elsewhere: :func:`parse_header_bytes`)."""
    path = os.fspath(path)
    with open(path, "rb", opener=_regular.regular_only) as f:
        head = f.read(8)
        n = validate.header_length(path, head, os.fstat(f.fileno()).st_size)
        raw = head + f.read(n)
    if len(raw) != 8 + n:
        raise CheckpointCorruptError(f"{path}: truncated: the header is cut short")
    return raw


def parse_header_bytes(raw: bytes, label: str, file_size: int) -> FileHeader:
    """:func:`read_header` of header bytes from :func:`header_bytes` of a file of
    ``file_size`` bytes; ``label`` names the file in errors."""
    n = validate.header_length(label, raw[:8], file_size)
    if len(raw) < 8 + n:
        raise CheckpointCorruptError(f"{label}: truncated: the header is cut short")
    return _decode_header(label, n, raw[8 : 8 + n], file_size)


def read_range(
    path: str | os.PathLike[str], begin: int, end: int, *, fd: int | None = None
) -> bytearray:
    """Bytes ``[begin, end)`` of a file (absolute offsets); a file too short for them is
    :class:`CheckpointCorruptError`. ``fd``: read from that descriptor of the file (the one its
    header was read from); ``path`` then only names it."""
    if fd is None:
        own = open_file(path)
        try:
            return read_range(path, begin, end, fd=own)
        finally:
            os.close(own)
    out, done = bytearray(end - begin), 0
    with memoryview(out) as view:
        while done < len(out):
            n = os.preadv(fd, [view[done:]], begin + done)
            if n <= 0:
                raise CheckpointCorruptError(
                    f"{os.fspath(path)}: truncated: bytes {begin}..{end} past its end"
                )
            done += n
    return out


def parse_header(data: FileBytes, label: str) -> FileHeader:
    """:func:`read_header` of a whole file held in memory; ``label`` names it in errors (and
    stands for the header's ``path``)."""
    size = len(data)
    n = validate.header_length(label, bytes(data[:8]), size)
    return _decode_header(label, n, bytes(data[8 : 8 + n]), size)


def verify_entries(
    header: FileHeader, view: Callable[[int, int], Any], *, threads: int = 2
) -> None:
    """Check every entry's checksum; ``view(begin, end)`` returns a buffer of the data bytes."""
    expected = header.checksums()
    names = list(header.entries)

    def check(name: str) -> str | None:
        _, _, begin, end = header.entries[name]
        return None if checksum(view(begin, end)) == expected[name] else name

    if threads > 1 and len(names) > 1:
        with concurrent.futures.ThreadPoolExecutor(threads, "trainguard-verify") as pool:
            bad = [n for n in pool.map(check, names) if n]
    else:
        bad = [n for n in map(check, names) if n]
    if bad:
        raise CheckpointCorruptError(
            f"{header.path}: checksum mismatch in tensor {bad[0]!r}"
            + (f" (and {len(bad) - 1} more: {bad[1:5]})" if len(bad) > 1 else "")
            + "; the file is corrupt, load an older checkpoint"
        )


def verify_data(header: FileHeader, data: FileBytes) -> None:
    """Check every entry's checksum; ``data`` holds the whole file ``header`` describes."""
    start = header.data_start
    with memoryview(data) as whole:
        verify_entries(header, lambda b, e: whole[start + b : start + e])


def _map(fd: int, header: FileHeader, access: int) -> mmap.mmap:
    """Map the whole file ``header`` describes, open as ``fd`` (the descriptor its header was
    read from); a file that shrank since is corrupt."""
    if os.fstat(fd).st_size < header.file_size:
        raise CheckpointCorruptError(f"{header.path}: truncated while it was being read")
    return mmap.mmap(fd, header.file_size, access=access)


def _verify_mapped(fd: int, header: FileHeader) -> None:
    if not header.is_trainguard:
        raise CheckpointCorruptError(f"{header.path}: not a trainguard file")
    mm = _map(fd, header, mmap.ACCESS_READ)
    try:
        verify_data(header, mm)
    finally:
        mm.close()


def verify_file(header: FileHeader) -> None:
    """Map the trainguard file ``header`` describes read-only and check every checksum.

    It opens ``header.path`` again: a file replaced there since ``header`` was read is reported
    corrupt. To check a file whose name another process may replace, use :func:`verify_path`,
    which reads the header and the data through one descriptor."""
    fd = open_file(header.path)
    try:
        _verify_mapped(fd, header)
    finally:
        os.close(fd)


def verify_path(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Read ``path``'s header and check every tensor's checksum, both through one descriptor
    (a file replaced under its name meanwhile is checked whole, old or new). ``dir_fd``: as for
    :func:`open_file`."""
    fd = open_file(path, dir_fd=dir_fd)
    try:
        _verify_mapped(fd, header_of(fd, os.fspath(path)))
    finally:
        os.close(fd)


def _trainguard_header(fd: int, path: str | os.PathLike[str]) -> FileHeader:
    header = header_of(fd, os.fspath(path))
    if not header.is_trainguard:
        raise CheckpointCorruptError(
            f"{header.path}: a safetensors file without trainguard metadata; open it with the "
            "safetensors package instead"
        )
    return header


def check_file(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> FileHeader:
    """Every check :func:`load_file` makes, without keeping the state: the header's fields,
    every checksum, and the skeleton against the entries (a missing tensor, a shape that does
    not fit its bytes, a pickled leaf without ``allow_pickle``). Pickled leaves are never
    unpickled here. Returns the header; raises :class:`CheckpointError` naming the problem."""
    fd = open_file(path)
    try:
        header = _trainguard_header(fd, path)
        mm = _map(fd, header, mmap.ACCESS_COPY)  # writable to torch (no page is ever written)
    finally:
        os.close(fd)  # the mapping holds the file
    try:
        _rebuild(header, mm, verify=True, allow_pickle=allow_pickle, unpickle=False, sharded=True)
    finally:
        with contextlib.suppress(BufferError):  # views still alive: the collector closes it
            mm.close()
    return header


def load_file(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    dir_fd: int | None = None,
) -> tuple[Any, FileHeader]:
    """Map a checkpoint file and rebuild its state; returns ``(state, header)``.

    Tensors are views of a private (copy-on-write) mapping of the file: nothing is read until it
    is touched, and writing to a tensor never changes the file. Each entry gets a storage of its
    own that starts at its first byte (some torch functions, ``torch.set_rng_state`` among them,
    ignore a tensor's storage offset). ``verify`` checks every tensor's checksum and the
    skeleton's first (a mismatch raises :class:`CheckpointCorruptError` naming the tensor). The
    header and skeleton are checked either way: a malformed file raises
    :class:`CheckpointCorruptError` saying what is wrong. The mapping is released when the last
    tensor is. The header and the data are read through one descriptor, so a file replaced
    under ``path`` meanwhile (an atomic save over it) is loaded whole, old or new, never mixed.
    ``dir_fd``: as for :func:`open_file`.
    """
    fd = open_file(path, dir_fd=dir_fd)
    try:
        header = _trainguard_header(fd, path)
        mm = _map(fd, header, mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the mapping holds the file
    return _rebuild(header, mm, verify=verify, allow_pickle=allow_pickle), header


def load_buffer(
    data: FileBytes, label: str, *, verify: bool = True, allow_pickle: bool = False
) -> tuple[Any, FileHeader]:
    """:func:`load_file` of a whole file held in memory (a copy received from a peer): the
    tensors are views of ``data``; ``label`` names it in errors."""
    header = parse_header(data, label)
    if not header.is_trainguard:
        raise CheckpointCorruptError(f"{label}: not a trainguard file")
    return _rebuild(header, data, verify=verify, allow_pickle=allow_pickle), header


def _rebuild(
    header: FileHeader,
    data: FileBytes,
    *,
    verify: bool,
    allow_pickle: bool,
    unpickle: bool = True,
    sharded: bool = False,
) -> Any:
    """The state of the file ``header`` describes, as views of ``data`` (the whole file)."""
    import torch

    from trainguard.checkpoint.format.layout import unflatten

    if verify:
        started = time.monotonic()
        verify_data(header, data)
        logger.debug("verified %s in %.3f s", header.path, time.monotonic() - started)
    skeleton = validate.check_skeleton(header.path, header.metadata, verify=verify)
    start = header.data_start
    tensors = {
        name: torch.frombuffer(data, dtype=torch.uint8, count=e - b, offset=start + b)
        if e > b
        else torch.empty(0, dtype=torch.uint8)
        for name, (_, _, b, e) in header.entries.items()
    }
    try:
        return unflatten(
            skeleton, tensors, allow_pickle=allow_pickle, unpickle=unpickle, sharded=sharded
        )
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{header.path}: {exc}") from None
