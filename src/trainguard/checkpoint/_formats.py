"""The old home of :mod:`.format.kinds`, kept for :mod:`.dcp` until it imports from there.

``checkpoint/dcp/`` is edited on another branch while the file format moves into
:mod:`.format`; once both are merged, its imports move to :mod:`.format.kinds` and this
module goes.
"""

from __future__ import annotations

from trainguard.checkpoint.format.kinds import (
    FORMATS,
    MAX_DEPTH,
    MAX_HEADER,
    SAFETENSORS_DTYPES,
    SAFETENSORS_ITEMSIZE,
    TORCH_DTYPE_NAMES,
    ZIP_MAGIC,
    is_torch_file,
)

__all__ = [
    "FORMATS",
    "MAX_DEPTH",
    "MAX_HEADER",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_ITEMSIZE",
    "TORCH_DTYPE_NAMES",
    "ZIP_MAGIC",
    "is_torch_file",
]
