"""Checks of a checkpoint file's header, for files nobody vouches for (no torch needed).

Every check raises :class:`CheckpointCorruptError` naming the file and what is wrong, before
anything is allocated or mapped on the header's word: the header's length fits the file; its
JSON is an object whose entries have a dtype from a fixed table, a shape of non-negative
integers whose product times the element size is the entry's byte count, and integer offsets
``0 <= begin <= end <= data size`` that do not overlap; ``__metadata__`` maps strings to
strings; the trainguard metadata (checksums, skeleton, format version) has the types it must.
Nesting and numbers outside what JSON decoding handles (``1e999``, thousands of digits, deep
brackets) are refused the same way, never as ``RecursionError`` or ``OverflowError``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from typing import Any

import xxhash

from trainguard.checkpoint.format.kinds import MAX_HEADER, SAFETENSORS_ITEMSIZE
from trainguard.errors import CheckpointCorruptError

__all__ = [
    "Entries",
    "check_checksums",
    "check_entries",
    "check_skeleton",
    "decode_json",
    "header_length",
]

#: name -> (dtype code, shape, begin, end); offsets count from the data section's start.
Entries = dict[str, tuple[str, list[int], int, int]]

#: The format versions this reader understands ("2" added the skeleton's checksum).
VERSIONS = ("1", "2")
_HEX16 = re.compile(r"[0-9a-f]{16}")


def _corrupt(label: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{label}: malformed header: {what}; the file is damaged or was not written by "
        "trainguard (load an older checkpoint)"
    )


def header_length(label: str, head: bytes, size: int) -> int:
    """The header's length ``n`` from its first 8 bytes, checked against the file's size."""
    if len(head) < 8:
        raise CheckpointCorruptError(
            f"{label}: truncated: {size} bytes, too short to hold a header"
        )
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointCorruptError(
            f"{label}: truncated or not a checkpoint: the header claims {n} bytes but the "
            f"file has {size}" + (f" (at most {MAX_HEADER} are allowed)" if n > MAX_HEADER else "")
        )
    return int(n)


def decode_json(label: str, what: str, raw: bytes | str) -> Any:
    """``json.loads`` whose every failure (syntax, nesting, huge numbers, bad UTF-8) is a
    :class:`CheckpointCorruptError` naming ``what`` was being decoded."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise _corrupt(label, f"{what} nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise _corrupt(label, f"{what} is not valid JSON ({exc})") from None


def _is_int(value: object) -> bool:
    return type(value) is int


def _entry(label: str, name: str, info: object, data_size: int) -> tuple[str, list[int], int, int]:
    if not isinstance(info, dict):
        raise _corrupt(label, f"entry {name!r} is a {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
        raise _corrupt(label, f"entry {name!r} has dtype {dtype!r}, not a known dtype code")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise _corrupt(label, f"entry {name!r} has shape {shape!r}, not non-negative integers")
    if (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(x) for x in offsets)
        and 0 <= offsets[0] <= offsets[1]
        and offsets[1] > data_size
    ):
        raise _corrupt(
            label,
            f"truncated: entry {name!r} has data_offsets {offsets!r}, past the end of the data "
            f"section ({data_size} bytes): the file was cut short",
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(x) for x in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise _corrupt(
            label,
            f"entry {name!r} has data_offsets {offsets!r}; they must be two integers with "
            f"0 <= begin <= end <= {data_size} (the data section's size)",
        )
    begin, end = offsets
    if math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype] != end - begin:
        raise _corrupt(
            label,
            f"entry {name!r}: shape {shape} of {dtype} needs "
            f"{math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]} bytes, its offsets hold "
            f"{end - begin}",
        )
    return dtype, list(shape), begin, end


def check_entries(label: str, header: object, data_size: int) -> tuple[Entries, dict[str, str]]:
    """The entries and metadata of a decoded header, every field checked (see the module)."""
    if not isinstance(header, dict):
        raise _corrupt(label, f"the header is a {type(header).__name__}, not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(label, "__metadata__ must be an object of strings")
    entries: Entries = {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _entry(label, name, info, data_size)
    spans = sorted((b, e, n) for n, (_, _, b, e) in entries.items() if e > b)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _corrupt(label, f"entries {first!r} and {second!r} overlap")
    return entries, dict(metadata)


def check_checksums(label: str, metadata: dict[str, str], entries: Entries) -> dict[str, str]:
    """The checksums a trainguard file's metadata holds: one of 16 hex digits per entry."""
    version = metadata.get("format_version", "1")
    if version not in VERSIONS:
        raise CheckpointCorruptError(
            f"{label}: format_version {version!r}; this trainguard reads {', '.join(VERSIONS)} "
            "(the file is damaged, or a newer trainguard wrote it: upgrade to read it)"
        )
    sums = decode_json(label, "the checksums", metadata.get("checksums", "{}"))
    if not isinstance(sums, dict) or not all(
        isinstance(v, str) and _HEX16.fullmatch(v) for v in sums.values()
    ):
        raise _corrupt(label, "checksums must map entry names to 16 hex digits")
    missing = [n for n in entries if n not in sums]
    if missing:
        raise CheckpointCorruptError(f"{label}: no checksum for tensor(s) {missing[:5]}")
    return dict(sums)


def skeleton_checksum(text: str) -> str:
    """The checksum of a skeleton's JSON text, as the header's ``skeleton_checksum`` holds it."""
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def check_skeleton(label: str, metadata: dict[str, str], *, verify: bool) -> Any:
    """The skeleton of a trainguard file, decoded; with ``verify``, its checksum checked too
    (format version 2 requires one)."""
    text = metadata.get("skeleton", "null")
    expected = metadata.get("skeleton_checksum")
    required = expected is not None or metadata.get("format_version", "1") != "1"
    if verify and required and expected != skeleton_checksum(text):
        raise CheckpointCorruptError(
            f"{label}: checksum mismatch in the skeleton (the state's structure and its "
            "plain values); the file is corrupt, load an older checkpoint"
        )
    return decode_json(label, "the skeleton", text)
