"""Rebuild a state from its skeleton (see :mod:`.layout`), checking every node on the way.

The skeleton may come from a file nobody vouches for: :func:`unflatten` checks each node's tag
and fields before it builds anything. :func:`largest_leaf` walks a skeleton written here to
name what makes a header too large.
"""

from __future__ import annotations

import base64
import json
import math
import pickle as _pickling
from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint.format import snode
from trainguard.checkpoint.format._skelbase import SCALARS, dtype_from_name, key_repr
from trainguard.checkpoint.format.kinds import MAX_DEPTH
from trainguard.errors import CheckpointCorruptError, CheckpointError, CheckpointPickleError


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
    types of its fields, nesting at most :data:`.kinds.MAX_DEPTH` deep, a tensor's dtype
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
            best = max(best, (key_repr(path), size), key=lambda item: item[1])
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
                f"{key_repr(path[:8])}...: the skeleton nests more than {MAX_DEPTH} levels"
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
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], SCALARS) for kv in value
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
                f"{key_repr(path)}: the checkpoint holds sharded tensors (DTensor); load it "
                "with load(path, into=target_state), where target_state has tensors (or "
                "DTensors) of the saved global shapes to fill"
            )
        name = node.get("S")
        raw = self.data.get(name) if isinstance(name, str) else None
        size = None if raw is None else raw.numel()
        snode.check(node, key_repr(path), size, dtype_from_name(node.get("dtype")))

    def pickled(self, raw: bytes, path: tuple[Any, ...]) -> Any:
        if not self.allow_pickle:
            raise CheckpointPickleError(
                f"{key_repr(path)} was saved with pickle; pass allow_pickle=True to load it "
                "(only for files you trust: unpickling can run arbitrary code)"
            )
        return _pickling.loads(raw) if self.unpickle else None

    def tensor(self, node: dict[str, Any], path: tuple[Any, ...]) -> torch.Tensor:
        raw = self.data.get(node["T"]) if isinstance(node["T"], str) else None
        if raw is None:
            raise CheckpointCorruptError(f"{key_repr(path)}: tensor {node['T']!r} is missing")
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
        return CheckpointCorruptError(f"{key_repr(path)}: malformed skeleton: {what}")
