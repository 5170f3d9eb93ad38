"""The old home of :mod:`.format.validate`, kept for :mod:`.dcp` until it imports from there.

``checkpoint/dcp/`` is edited on another branch while the file format moves into
:mod:`.format`; once both are merged, its imports move to :mod:`.format.validate` and this
module goes.
"""

from __future__ import annotations

from trainguard.checkpoint.format.validate import (
    VERSIONS,
    Entries,
    check_checksums,
    check_entries,
    check_skeleton,
    decode_json,
    header_length,
    skeleton_checksum,
)

__all__ = [
    "VERSIONS",
    "Entries",
    "check_checksums",
    "check_entries",
    "check_skeleton",
    "decode_json",
    "header_length",
    "skeleton_checksum",
]
