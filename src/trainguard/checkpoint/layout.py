"""Flatten a nested state dict into file entries plus a JSON skeleton, and build it back.

:func:`flatten` walks dicts (any key JSON can hold: str, int, float, bool, None), lists and
tuples. Tensors become *entries*: regions of bytes that the file stores once each. Every other
leaf is kept in the *skeleton*, a JSON tree with tagged containers::

    {"D": [[key, node], ...]}        dict (OrderedDict comes back as a dict)
    {"L": [node, ...]}  {"U": [...]}   list, tuple
    {"T": entry, "dtype": "float32", "shape": [...], "stride": [...], "offset": n}
                                     a tensor; stride/offset only when it is a view
    {"S": entry | null, "dtype": ..., "shape": [...], "offsets": [...], "sizes": [...], ...}
                                     a DTensor's local chunk (see :mod:`._snode`)
    {"F": "nan"}  {"B": base64}  {"dtype": "bfloat16"}  {"device": "cuda:0"}  {"size": [...]}
    {"P": base64}                    a pickled leaf (only with pickle=True)
    "text", 3, 2.5, true, null       JSON scalars as they are

Tensors that share a storage (views of one another, ``w`` and ``w.t()``, a slice and its base)
are written once: one entry holds the bytes their views span, and each view is rebuilt with
``as_strided`` on it, so the views share memory again after loading. A tensor that shares with
nobody is written contiguously (only its own elements, even when it is a slice of something
larger that is not in the state).

This module is the only one that knows the skeleton's shape; :mod:`fileformat` stores it, and
the writer process rebuilds a state from it only for ``format="torch"``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import pickle as _pickling
from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint import _snode
from trainguard.checkpoint._formats import MAX_DEPTH, SAFETENSORS_DTYPES, TORCH_DTYPE_NAMES
from trainguard.checkpoint._shards import is_dtensor
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPickleError,
    ConfigError,
)

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

_SCALARS = (str, int, float, bool, type(None))


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


def tensor_entry(name: str, t: torch.Tensor) -> Entry:
    """An entry whose bytes are ``t``'s elements in C order (``U8`` of its bytes when the dtype
    has no safetensors code)."""
    code = SAFETENSORS_DTYPES.get(dtype_name(t.dtype))
    nbytes = t.numel() * t.element_size()
    shape = tuple(t.shape) if code else (nbytes,)
    return Entry(name, code or "U8", shape, nbytes, t.element_size(), t)


def _key_repr(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def _pickled(value: Any, path: tuple[Any, ...], allow: bool) -> dict[str, str]:
    if not allow:
        raise CheckpointPickleError(
            f"{_key_repr(path)} is a {type(value).__module__}.{type(value).__qualname__}, which "
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
            shown = _key_repr(path[:8]) + ("..." if len(path) > 8 else "")
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
                if not isinstance(key, _SCALARS) or (type(key) is float and not math.isfinite(key)):
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
                f"{_key_repr(path)}: only dense (strided) tensors can be checkpointed, "
                f"not layout={t.layout} on {t.device}"
            )
        ref: dict[str, Any] = {"T": None, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        self.leaves.append((self._name(path), t.detach(), ref))
        return ref

    def shard(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        """An "S" node; its chunk becomes an entry of its own (never merged: see _snode)."""
        if not self.allow_sharded:
            raise ConfigError(
                f'{_key_repr(path)} is a DTensor (sharded): format="torch" cannot hold '
                'sharded tensors; save with format="trainguard" and load with '
                "load(path, into=target_state)"
            )
        self.sharded = True
        name = self._name(path)  # reserved on every rank: the same entry name everywhere
        node, local = _snode.make(t, _key_repr(path), dtype_name(t.dtype))
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


def unflatten(
    skeleton: Any,
    data: Mapping[str, torch.Tensor],
    *,
    allow_pickle: bool = False,
    unpickle: bool = True,
    sharded: bool = False,
) -> Any:
    """Rebuild the state from a skeleton and ``data``: entry name -> 1-D ``uint8`` tensor.

    Tensors are views of ``data`` (no copy); views that shared a storage share one again. The
    skeleton may come from a file nobody vouches for: every node is checked (its tag and the
    types of its fields, nesting at most :data:`._formats.MAX_DEPTH` deep, a tensor's dtype
    from a fixed table, its shape and strides inside its entry's bytes, never more elements
    than the entry holds), and a bad one raises :class:`CheckpointCorruptError` naming its key.
    With ``unpickle=False`` pickled leaves are checked but not unpickled (they become None).
    A sharded leaf ("S" node) raises :class:`CheckpointError` (load such a checkpoint with
    ``load(path, into=target_state)``), unless ``sharded``: then its node is checked and it
    becomes None.
    """
    return _Builder(data, allow_pickle, unpickle, sharded).build(skeleton, ())


def largest_leaf(skeleton: Any) -> tuple[str, int]:
    """The key of the skeleton's leaf that takes the most JSON bytes, and that size."""
    best = ("state", -1)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(skeleton, ())]
    while stack:
        node, path = stack.pop()
        children = _children(node)
        if children is None:
            size = len(json.dumps(node, separators=(",", ":")))
            best = max(best, (_key_repr(path), size), key=lambda item: item[1])
        else:
            stack.extend((child, (*path, key)) for key, child in children)
    return best


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The (key, child) pairs of a container node of a skeleton written here, else None."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "D":
            return [(k, v) for k, v in value]
        if tag in ("L", "U"):
            return list(enumerate(value))
    return None


def _is_index(value: object) -> bool:
    return type(value) is int and value >= 0


_TENSOR_KEYS = frozenset(("T", "dtype", "shape", "stride", "offset"))
_FLOATS = ("nan", "inf", "-inf")


class _Builder:
    """:func:`unflatten`'s walk: one method per kind of node, every field checked."""

    def __init__(
        self,
        data: Mapping[str, torch.Tensor],
        allow_pickle: bool,
        unpickle: bool,
        sharded: bool = False,
    ) -> None:
        self.data = data
        self.allow_pickle = allow_pickle
        self.unpickle = unpickle
        self.sharded = sharded

    def build(self, node: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise CheckpointCorruptError(
                f"{_key_repr(path[:8])}...: the skeleton nests more than {MAX_DEPTH} levels"
            )
        if isinstance(node, (str, int, float)) or node is None:
            return node
        if not isinstance(node, dict) or not node:
            raise self.bad(path, f"a {type(node).__name__} where a tagged node belongs")
        if "T" in node:
            if not node.keys() <= _TENSOR_KEYS:
                raise self.bad(path, f"unexpected fields {sorted(node.keys() - _TENSOR_KEYS)}")
            return self.tensor(node, path)
        if "S" in node:
            return self.shard(node, path)
        if len(node) != 1:
            raise self.bad(path, f"a node with several tags {sorted(node)}")
        ((tag, value),) = node.items()
        if tag == "D":
            if not isinstance(value, list) or not all(
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], _SCALARS)
                for kv in value
            ):
                raise self.bad(path, "a dict that is not a list of [key, value] pairs")
            return {k: self.build(v, (*path, k)) for k, v in value}
        if tag in ("L", "U"):
            if not isinstance(value, list):
                raise self.bad(path, f"a {tag!r} node without a list")
            items = [self.build(v, (*path, i)) for i, v in enumerate(value)]
            return items if tag == "L" else tuple(items)
        return self.leaf(tag, value, path)

    def leaf(self, tag: str, value: Any, path: tuple[Any, ...]) -> Any:
        if tag == "F" and value in _FLOATS:
            return float(value)
        if tag in ("B", "P") and isinstance(value, str):
            try:
                raw = base64.b64decode(value, validate=True)
            except ValueError:  # binascii.Error
                raise self.bad(path, "bytes that are not base64") from None
            return raw if tag == "B" else self.pickled(raw, path)
        if tag == "dtype":
            return dtype_from_name(value)
        if tag == "device" and isinstance(value, str):
            try:
                return torch.device(value)
            except RuntimeError:
                raise self.bad(path, f"device {value!r}") from None
        if tag == "size" and isinstance(value, list) and all(map(_is_index, value)):
            return torch.Size(value)
        raise self.bad(path, f"a {tag!r} node holding {type(value).__name__}")

    def shard(self, node: dict[str, Any], path: tuple[Any, ...]) -> None:
        if not self.sharded:
            raise CheckpointError(
                f"{_key_repr(path)}: the checkpoint holds sharded tensors (DTensor); load it "
                "with load(path, into=target_state), where target_state has tensors (or "
                "DTensors) of the saved global shapes to fill"
            )
        name = node.get("S")
        raw = self.data.get(name) if isinstance(name, str) else None
        size = None if raw is None else raw.numel()
        _snode.check(node, _key_repr(path), size, dtype_from_name(node.get("dtype")))

    def pickled(self, raw: bytes, path: tuple[Any, ...]) -> Any:
        if not self.allow_pickle:
            raise CheckpointPickleError(
                f"{_key_repr(path)} was saved with pickle; pass allow_pickle=True to load it "
                "(only for files you trust: unpickling can run arbitrary code)"
            )
        return _pickling.loads(raw) if self.unpickle else None

    def tensor(self, node: dict[str, Any], path: tuple[Any, ...]) -> torch.Tensor:
        raw = self.data.get(node["T"]) if isinstance(node["T"], str) else None
        if raw is None:
            raise CheckpointCorruptError(f"{_key_repr(path)}: tensor {node['T']!r} is missing")
        dtype, shape = dtype_from_name(node.get("dtype")), node.get("shape")
        if not isinstance(shape, list) or not all(map(_is_index, shape)):
            raise self.bad(path, f"tensor shape {shape!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > raw.numel() or ("stride" not in node and nbytes != raw.numel()):
            raise self.bad(
                path,
                f"shape {shape} of {dtype} needs {nbytes} bytes, its entry holds {raw.numel()}",
            )
        try:
            if not raw.numel():
                return torch.empty(shape, dtype=dtype)
            typed = raw.view(dtype)
            if "stride" not in node:
                return typed.view(shape)
            return self.strided(typed, shape, node, path)
        except RuntimeError as exc:  # a dtype whose size does not divide the entry's, ...
            raise self.bad(path, f"tensor of {dtype}: {exc}") from None

    def strided(
        self, typed: torch.Tensor, shape: list[int], node: dict[str, Any], path: tuple[Any, ...]
    ) -> torch.Tensor:
        stride, offset = node["stride"], node.get("offset")
        if (
            not isinstance(stride, list)
            or len(stride) != len(shape)
            or not all(map(_is_index, stride))
            or not isinstance(offset, int)
            or not _is_index(offset)
        ):
            raise self.bad(path, f"stride {stride!r} and offset {offset!r}")
        last = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if math.prod(shape) and last >= len(typed):
            raise self.bad(path, f"a view reaching past its entry's {len(typed)} elements")
        return torch.as_strided(typed, shape, stride, typed.storage_offset() + offset)

    @staticmethod
    def bad(path: tuple[Any, ...], what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{_key_repr(path)}: malformed skeleton: {what}")
