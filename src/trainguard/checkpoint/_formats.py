"""The kinds of checkpoint file and how to tell them apart (no torch, no other trainguard module).

A checkpoint file is either a trainguard file (safetensors-compatible, see :mod:`.fileformat`)
or, for ``format="torch"``, a ``torch.save`` zip archive, recognised by its first four bytes.
:mod:`.layout` and :mod:`.fileformat` both use the safetensors dtype codes, so they live here,
below both.
"""

from __future__ import annotations

import os

#: The values of the ``format=`` argument of a save, in the order :func:`.load` looks for parts.
FORMATS = ("trainguard", "torch")
#: The first bytes of a ``torch.save`` file (a zip archive).
ZIP_MAGIC = b"PK\x03\x04"

#: torch dtype name -> safetensors dtype code (dtypes not listed are stored as U8 bytes).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def is_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts like a ``torch.save`` file; OSError if it cannot be read."""
    with open(path, "rb") as f:
        return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
