"""The primitives both directions of the skeleton share (see :mod:`.layout`).

The scalar types a dict key may have, a leaf's key path as text for messages, and the names a
checkpoint gives torch dtypes, looked up in a fixed table.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.checkpoint.format.kinds import TORCH_DTYPE_NAMES
from trainguard.errors import CheckpointCorruptError

#: The types of dict keys (and leaves) that JSON holds as they are.
SCALARS = (str, int, float, bool, type(None))

_DTYPES: dict[str, torch.dtype] = {
    name: value
    for name in TORCH_DTYPE_NAMES
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}


def dtype_from_name(name: object) -> torch.dtype:
    """The torch dtype a checkpoint names, from a fixed table (never ``getattr(torch, name)``)."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointCorruptError(f"unknown dtype {name!r} in checkpoint")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name a checkpoint gives a torch dtype (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def key_repr(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)
