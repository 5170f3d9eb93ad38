"""The checkpoint file: a safetensors-compatible container with a checksum per tensor.

The public face of the file format's two sides, which live in :mod:`.format`:
:mod:`.format.write` (placing entries, hashing, the header, durable writes) and
:mod:`.format.read` (parsing a header, verifying checksums, loading), where the file's layout is
described. Importing this module needs no torch (the writer process starts without it);
:func:`load_file` and :func:`load_buffer` import it when they rebuild a state.
"""

from __future__ import annotations

from trainguard.checkpoint.format.kinds import SAFETENSORS_DTYPES
from trainguard.checkpoint.format.read import (
    FileBytes,
    FileHeader,
    check_file,
    header_bytes,
    load_buffer,
    load_file,
    parse_header,
    parse_header_bytes,
    read_header,
    read_range,
    verify_data,
    verify_entries,
    verify_file,
    verify_path,
)
from trainguard.checkpoint.format.write import (
    ALIGN,
    FORMAT,
    PlacedEntry,
    check_header_fits,
    checksum,
    encode_header,
    fsync_dir,
    place,
    write_file,
)
from trainguard.checkpoint.format.write import CHUNK as CHUNK  # public names outside __all__
from trainguard.checkpoint.format.write import FORMAT_VERSION as FORMAT_VERSION

__all__ = [  # noqa: RUF022 (plain sorted order, as tests/test_api.py checks)
    "ALIGN",
    "FORMAT",
    "FileBytes",
    "FileHeader",
    "PlacedEntry",
    "SAFETENSORS_DTYPES",
    "check_file",
    "check_header_fits",
    "checksum",
    "encode_header",
    "fsync_dir",
    "header_bytes",
    "load_buffer",
    "load_file",
    "parse_header",
    "parse_header_bytes",
    "place",
    "read_header",
    "read_range",
    "verify_data",
    "verify_entries",
    "verify_file",
    "verify_path",
    "write_file",
]
