"""Flatten a nested state dict into file entries plus a JSON skeleton, and build it back.

:func:`flatten` walks dicts (any key JSON can hold: str, int, float, bool, None), lists and
tuples. Tensors become *entries*: regions of bytes that the file stores once each. Every other
leaf is kept in the *skeleton*, a JSON tree with tagged containers::

    {"D": [[key, node], ...]}        dict (OrderedDict comes back as a dict)
    {"L": [node, ...]}  {"U": [...]}   list, tuple
    {"T": entry, "dtype": "float32", "shape": [...], "stride": [...], "offset": n}
                                     a tensor; stride/offset only when it is a view
    {"S": entry | null, "dtype": ..., "shape": [...], "offsets": [...], "sizes": [...], ...}
                                     a DTensor's local chunk (see :mod:`.snode`)
    {"F": "nan"}  {"B": base64}  {"dtype": "bfloat16"}  {"device": "cuda:0"}  {"size": [...]}
    {"P": base64}                    a pickled leaf (only with pickle=True)
    "text", 3, 2.5, true, null       JSON scalars as they are

Tensors that share a storage (views of one another, ``w`` and ``w.t()``, a slice and its base)
are written once: one entry holds the bytes their views span, and each view is rebuilt with
``as_strided`` on it, so the views share memory again after loading. A tensor that shares with
nobody is written contiguously (only its own elements, even when it is a slice of something
larger that is not in the state).

This module (with :mod:`._unflatten`) is the only one that knows the skeleton's shape;
:mod:`.read` and :mod:`.write` store it, and the writer process rebuilds a state from it only for ``format="torch"``. Flattening lives here;
building back (:func:`unflatten`, :func:`largest_leaf`) in :mod:`._unflatten`, and the
primitives both share (dtype names, key paths) in :mod:`._skelbase`; all are re-exported here,
the public place to import them from.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import pickle as _pickling
from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint.format import snode
from trainguard.checkpoint.format._skelbase import SCALARS, dtype_from_name, dtype_name, key_repr
from trainguard.checkpoint.format._unflatten import largest_leaf, unflatten
from trainguard.checkpoint.format.kinds import MAX_DEPTH, SAFETENSORS_DTYPES
from trainguard.checkpoint.format.shards import is_dtensor
from trainguard.errors import CheckpointError, CheckpointPickleError, ConfigError

__all__ = [
    "Entry",
    "Flat",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "largest_leaf",
    "tensor_entry",
    "unflatten",
]


@dataclasses.dataclass
class Entry:
    """One region of bytes in the file.

    ``source`` is a tensor whose elements, copied contiguously, are exactly the entry's bytes
    (the tensor itself, or a ``uint8`` span of a shared storage). ``dtype``/``shape`` are what
    safetensors readers see (``U8`` of ``nbytes`` when the real dtype has no safetensors code).
    ``align`` is the largest element size of the tensors that view this entry.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    align: int
    source: torch.Tensor


@dataclasses.dataclass
class Flat:
    """The result of :func:`flatten`: entries to copy and the JSON skeleton."""

    entries: list[Entry]
    skeleton: Any
    sharded: bool = False  # whether the state holds DTensors ("S" nodes)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def tensor_entry(name: str, t: torch.Tensor) -> Entry:
    """An entry whose bytes are ``t``'s elements in C order (``U8`` of its bytes when the dtype
    has no safetensors code)."""
    code = SAFETENSORS_DTYPES.get(dtype_name(t.dtype))
    nbytes = t.numel() * t.element_size()
    shape = tuple(t.shape) if code else (nbytes,)
    return Entry(name, code or "U8", shape, nbytes, t.element_size(), t)


def _pickled(value: Any, path: tuple[Any, ...], allow: bool) -> dict[str, str]:
    if not allow:
        raise CheckpointPickleError(
            f"{key_repr(path)} is a {type(value).__module__}.{type(value).__qualname__}, which "
            "JSON cannot hold; pass pickle=True to save (and allow_pickle=True to load), or "
            "convert it to tensors, numbers, strings, lists or dicts"
        )
    return {"P": base64.b64encode(_pickling.dumps(value, protocol=4)).decode()}


class _Flattener:
    def __init__(self, allow_pickle: bool, allow_sharded: bool) -> None:
        self.allow_pickle = allow_pickle
        self.allow_sharded = allow_sharded
        self.sharded = False
        self.leaves: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
        self.names: set[str] = set()

    def _name(self, path: tuple[Any, ...]) -> str:
        base = ".".join(str(k) for k in path) or "tensor"
        if base.startswith("__"):
            base = "_" + base.lstrip("_")
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def node(self, value: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            shown = key_repr(path[:8]) + ("..." if len(path) > 8 else "")
            raise CheckpointError(
                f"{shown}: the state nests containers more than {MAX_DEPTH} levels deep (or "
                "holds itself), which a checkpoint cannot hold: readers refuse deeper files; "
                "flatten that part of the state (a tensor, a string or a shallower structure)"
            )
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"F": repr(value)}
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if not isinstance(key, SCALARS) or (type(key) is float and not math.isfinite(key)):
                    return _pickled(value, path, self.allow_pickle)
                items.append([key, self.node(item, (*path, key))])
            return {"D": items}
        if type(value) is list:
            return {"L": [self.node(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, torch.Size):
            return {"size": list(value)}
        if type(value) is tuple:
            return {"U": [self.node(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, torch.dtype):
            return {"dtype": dtype_name(value)}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, bytes):
            return {"B": base64.b64encode(value).decode()}
        return _pickled(value, path, self.allow_pickle)

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        if is_dtensor(t):
            return self.shard(t, path)
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return _pickled(t, path, self.allow_pickle)
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise CheckpointError(
                f"{key_repr(path)}: only dense (strided) tensors can be checkpointed, "
                f"not layout={t.layout} on {t.device}"
            )
        ref: dict[str, Any] = {"T": None, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        self.leaves.append((self._name(path), t.detach(), ref))
        return ref

    def shard(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        """An "S" node; its chunk becomes an entry of its own (never merged: see snode)."""
        if not self.allow_sharded:
            raise ConfigError(
                f'{key_repr(path)} is a DTensor (sharded): format="torch" cannot hold '
                'sharded tensors; save with format="trainguard" and load with '
                "load(path, into=target_state)"
            )
        self.sharded = True
        name = self._name(path)  # reserved on every rank: the same entry name everywhere
        node, local = snode.make(t, key_repr(path), dtype_name(t.dtype))
        if local is not None:
            self.leaves.append((name, local, node))
        return node

    def entries(self) -> list[Entry]:
        groups: dict[tuple[str, int], list[int]] = {}
        singles: list[int] = []
        for i, (_, t, _) in enumerate(self.leaves):
            if t.numel() == 0 or "S" in self.leaves[i][2]:
                singles.append(i)
            else:
                key = (str(t.device), t.untyped_storage().data_ptr())
                groups.setdefault(key, []).append(i)
        entries: list[tuple[int, Entry]] = []
        for members in groups.values():
            if len(members) == 1 or not self._shared(members, entries):
                singles.extend(members)
        for i in singles:
            name, t, ref = self.leaves[i]
            entries.append((i, tensor_entry(name, t)))
            ref["S" if "S" in ref else "T"] = name
        entries.sort(key=lambda item: item[0])  # state order, for readable files
        return [e for _, e in entries]

    def _shared(self, members: list[int], out: list[tuple[int, Entry]]) -> bool:
        """Make one entry for views of one storage; False if their spans cannot be aligned."""
        tensors = [self.leaves[i][1] for i in members]
        align = max(t.element_size() for t in tensors)
        lo = min(t.storage_offset() * t.element_size() for t in tensors)
        hi = max(
            (
                t.storage_offset()
                + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
                + 1
            )
            * t.element_size()
            for t in tensors
        )
        lo -= lo % align
        hi += -hi % align
        storage = tensors[0].untyped_storage()
        if hi > storage.nbytes() or any(
            (t.storage_offset() * t.element_size() - lo) % t.element_size()
            or t.numel() * t.element_size() > hi - lo  # expanded: readers refuse such views
            for t in tensors
        ):
            return False
        span = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
        span.set_(storage, lo, (hi - lo,), (1,))
        name, code = self.leaves[members[0]][0], "U8"
        shape: tuple[int, ...] = (int(hi - lo),)
        for i, t in zip(members, tensors, strict=True):
            tcode = SAFETENSORS_DTYPES.get(dtype_name(t.dtype))
            if (
                tcode
                and t.is_contiguous()
                and t.storage_offset() * t.element_size() == lo
                and t.numel() * t.element_size() == hi - lo
            ):
                name, shape, code = self.leaves[i][0], tuple(int(s) for s in t.shape), tcode
                break
        for t, i in zip(tensors, members, strict=True):
            ref = self.leaves[i][2]
            ref["T"] = name
            ref["stride"] = list(t.stride())
            ref["offset"] = (t.storage_offset() * t.element_size() - lo) // t.element_size()
        out.append((members[0], Entry(name, code, shape, int(hi - lo), align, span)))
        return True


def flatten(state: Any, *, pickle: bool = False, allow_sharded: bool = True) -> Flat:
    """Split ``state`` into entries (tensor bytes) and a JSON-serializable skeleton.

    Raises :class:`CheckpointPickleError` naming the key of a leaf JSON cannot hold, unless
    ``pickle`` is true (the argument keeps the name of the ``save(..., pickle=)`` option it
    serves; such leaves are then stored pickled). The entries' ``source`` tensors are the live
    tensors: copy them before the state changes. A DTensor leaf becomes an "S" node and its
    local chunk an entry (replicas that another rank writes none); ``allow_sharded=False``
    (``format="torch"``) refuses DTensors with :class:`ConfigError`; a ``Partial`` one is a
    :class:`CheckpointError` naming its key.
    """
    flattener = _Flattener(pickle, allow_sharded)
    skeleton = flattener.node(state, ())
    entries = flattener.entries()
    return Flat(entries, skeleton, flattener.sharded)
