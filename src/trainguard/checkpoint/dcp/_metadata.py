"""DCP's metadata file of a checkpoint directory: written atomically, read with a narrow
unpickler.

DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` is a graph of its own dataclasses
(plus torch dtypes and sizes), stored pickled under ``.metadata`` as DCP's own
``FileSystemWriter`` does. :func:`write` makes it durable before the commit marker exists (a
temporary file, fsync, rename, directory fsync). :func:`read` unpickles only the classes such a
graph holds, so a planted ``.metadata`` cannot run code, and sets the state (pickle's ``BUILD``)
only of the metadata objects it creates, so a planted file, refused, leaves nothing changed in
the process: not an attribute of an allowed class, function or enum member (``BUILD`` on a
global would set it for every later load, good checkpoints included).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
import torch.distributed.checkpoint.metadata as _dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from trainguard.checkpoint._regular import open_regular
from trainguard.checkpoint.format import tmpfile as _tmpfile
from trainguard.checkpoint.format.kinds import TORCH_DTYPE_NAMES
from trainguard.checkpoint.format.write import fsync_dir
from trainguard.errors import CheckpointCorruptError, CheckpointError

__all__ = ["ALLOWED", "NAME", "read", "write"]

#: The file name, as DCP's own file system storage uses it.
NAME = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"

#: DCP's metadata dataclasses: the names the allow-list resolves in DCP's metadata module (with
#: the ``_MEM_FORMAT_ENCODING`` enum) and the classes a ``BUILD`` may set the state of.
_DATACLASSES = (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
)

#: Every global a ``Metadata`` that :class:`StorageWriter` writes refers to, as DCP of the
#: installed torch pickles it (dataclasses of DCP's metadata module, ``torch.Size``, dtypes by
#: name, a layout through ``torch.serialization._get_layout``); checked against the opcodes of
#: real checkpoints. Nothing else is resolved: not another name of those modules, and never a
#: dotted name (protocol 4 resolves ``module`` then ``a.b`` attribute by attribute).
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *((_DCP, name) for name in (*_DATACLASSES, "_MEM_FORMAT_ENCODING")),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        *(("torch", name) for name in TORCH_DTYPE_NAMES if hasattr(torch, name)),
    }
)


#: The classes whose instances a ``BUILD`` may set the state of: DCP's metadata dataclasses,
#: which pickle as ``NEWOBJ`` (a fresh instance) then ``BUILD``. Not the enum: its members are
#: singletons of the process.
_BUILDABLE: frozenset[type] = frozenset(getattr(_dcp_metadata, name) for name in _DATACLASSES)

_BUILD = cast("Callable[[Any], None]", pickle._Unpickler.dispatch[pickle.BUILD[0]])


class _Unpickler(pickle._Unpickler):
    """pickle's Python unpickler (a subclass can narrow its opcodes; the C one's only its
    globals), narrowed to the globals of :data:`ALLOWED` and to ``BUILD`` on instances of
    :data:`_BUILDABLE` (as torch's ``weights_only`` unpickler allows it)."""

    stack: list[Any]  # the unpickler's stack (set by load)
    dispatch: ClassVar[dict[int, Callable[[pickle.Unpickler], None]]] = dict(
        pickle._Unpickler.dispatch
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which DCP's metadata never holds (it may run code)"
        )

    def load_build(self) -> None:
        """``BUILD``: set the state of the object below the top of the stack to the top."""
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _BUILDABLE:
            raise pickle.UnpicklingError(
                f"it sets the state of {_what(target)}, which DCP's metadata never does (only "
                "of the metadata objects it creates); that would change it for the whole process"
            )
        _BUILD(self)

    dispatch[pickle.BUILD[0]] = cast("Callable[[pickle.Unpickler], None]", load_build)


def _what(target: Any) -> str:
    if isinstance(target, type) or callable(target):
        module = getattr(target, "__module__", "?")
        return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"
    return f"a {type(target).__module__}.{type(target).__qualname__} object"


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


def read(directory: str, *, dir_fd: int | None = None) -> Metadata:
    """The metadata of the checkpoint in ``directory``; :class:`CheckpointError` when there is
    none, :class:`CheckpointCorruptError` when it is not DCP metadata. ``dir_fd``: read it in
    that descriptor of the directory (``directory`` then only names it)."""
    path = os.path.join(directory, NAME)
    try:
        with open(open_regular(path if dir_fd is None else NAME, dir_fd=dir_fd), "rb") as f:
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
