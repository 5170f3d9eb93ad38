"""The kinds of checkpoint file and how to tell them apart (no torch, no other trainguard module).

A checkpoint file is either a trainguard file (safetensors-compatible, see :mod:`.read`)
or, for ``format="torch"``, a ``torch.save`` zip archive, recognised by its first four bytes.
:mod:`.layout`, :mod:`.read` and :mod:`.write` use the safetensors dtype codes, so they live
here, below them.
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

#: safetensors dtype code -> bytes per element: the only codes a file may name.
SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "C64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}

#: The torch dtype names a skeleton may name: looked up in this fixed table, never with
#: ``getattr(torch, name)`` (names this torch lacks are refused like unknown ones).
TORCH_DTYPE_NAMES = (
    *SAFETENSORS_DTYPES,
    *("complex128", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"),
    *("float4_e2m1fn_x2", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8"),
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
    *("qint32", "qint8", "quint2x4", "quint4x2", "quint8"),
)

#: How deeply containers (dicts, lists, tuples) may nest in a saved state. ``save`` refuses a
#: deeper state and the reader refuses a deeper skeleton, so either side fails the same way.
MAX_DEPTH = 100
#: The largest header (the 8-byte length excluded) a reader accepts: safetensors' own limit.
MAX_HEADER = 100 << 20


def is_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts like a ``torch.save`` file; OSError if it cannot be read."""
    from trainguard.checkpoint._regular import regular_only

    with open(path, "rb", opener=regular_only) as f:
        return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
