"""Asynchronous, verifiable checkpoints.

::

    from trainguard.checkpoint import AsyncCheckpointer, latest, load

    with AsyncCheckpointer() as ckpt:             # one persistent writer process
        ckpt.protect(optimizer)                   # fence overlapped staging before step()
        ckpt.save(state, "ckpt/step100", on_durable=print)
        ckpt.poll()                               # callbacks and errors, never blocks
    state = load(latest("ckpt"))

Modules: :mod:`.layout` (state <-> entries + JSON skeleton), :mod:`.fileformat`
(safetensors-compatible files with checksums), :mod:`.staging` (shared-memory buffers),
:mod:`.writer` (the writer process), :mod:`.async_save` (the checkpointer, load, latest).

Names are imported on first use, so that importing this package (as the writer process does)
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.checkpoint.async_save import (
        AsyncCheckpointer,
        SaveHandle,
        SaveInfo,
        latest,
        load,
    )

__all__ = ["AsyncCheckpointer", "SaveHandle", "SaveInfo", "latest", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("trainguard.checkpoint.async_save"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
