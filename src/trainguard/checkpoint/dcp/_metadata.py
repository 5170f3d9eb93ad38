"""DCP's metadata file of a checkpoint directory: written atomically, read with a narrow
unpickler.

DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` is a graph of its own dataclasses
(plus torch dtypes and sizes), stored pickled under ``.metadata`` as DCP's own
``FileSystemWriter`` does. :func:`write` makes it durable before the commit marker exists (a
temporary file, fsync, rename, directory fsync). :func:`read` unpickles only the classes such a
graph holds, so a planted ``.metadata`` cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trainguard.checkpoint import _tmpfile
from trainguard.checkpoint.fileformat import fsync_dir
from trainguard.errors import CheckpointCorruptError, CheckpointError

__all__ = ["NAME", "read", "write"]

#: The file name, as DCP's own file system storage uses it.
NAME = ".metadata"

_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "complex", "bytearray"}
_LAYOUT = ("torch.serialization", "_get_layout")  # how a torch.layout pickles
_TORCH = (torch.dtype, torch.layout, torch.memory_format)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (
            module == "collections" and name == "OrderedDict"
        ):
            return super().find_class(module, name)
        if (module == "builtins" and name in _BUILTINS) or (module, name) == _LAYOUT:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, _TORCH):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def write(directory: str, metadata: Metadata, *, fsync: bool = True) -> None:
    """Write ``metadata`` to ``directory/.metadata`` durably and atomically."""
    path = os.path.join(directory, NAME)
    fd, tmp = _tmpfile.create(path)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(metadata, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            _tmpfile.publish(f.fileno(), tmp, path)
    except BaseException:
        _tmpfile.discard(tmp)
        raise
    if fsync:
        fsync_dir(directory)


def read(directory: str) -> Metadata:
    """The metadata of the checkpoint in ``directory``; :class:`CheckpointError` when there is
    none, :class:`CheckpointCorruptError` when it is not DCP metadata."""
    path = os.path.join(directory, NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} has no {NAME}: it is not a checkpoint written by "
            "trainguard.checkpoint.dcp.StorageWriter (or its save never finished)"
        ) from None
    try:
        metadata = _Unpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc}); the checkpoint is "
            "damaged, load an older one"
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptError(f"{path}: not DCP metadata; load an older checkpoint")
    return metadata
