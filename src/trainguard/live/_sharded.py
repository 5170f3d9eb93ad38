"""DTensor state in live recovery: a state's local form, its layout, and loading it on a new mesh.

A DTensor leaf (FSDP2's ``fully_shard``, HSDP on a 2-D mesh, tensor parallelism by placements)
travels as its local tensor: :func:`local_form` replaces every DTensor leaf of a state by
``to_local()`` (no copy) and lists where they were, so the transfer only ever moves plain
tensors and a receiver takes them into its own local tensors, in place.

Which ranks hold the same local shards follows from the placements and the mesh:
:func:`signature` lists, for every DTensor the state is built on (the module's leaves and each
optimizer's parameters: an optimizer's state mirrors its parameters and may not exist yet on a
fresh optimizer), its global shape and this rank's box (offsets and sizes). Ranks with equal
signatures hold the same shards (the same coordinates on every sharded mesh dimension); the
signature becomes part of the replica group key.

:func:`install` turns a local form back into DTensors on *this* rank's objects (the mesh and
placements of its own leaf at the same path, or for an optimizer's state of its parameter),
checking that every local shape matches; the result goes to the objects' ``load_state_dict``.
The objects may be new ones, rebuilt on the round's mesh: the mesh of a DTensor is bound to the
process group it was made on, so a model is sharded again every round (``fully_shard``) and
the state moves into it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint.format.shards import dtensor_box, is_dtensor
from trainguard.errors import ConfigError

__all__ = ["Targets", "install", "local_form", "signature"]

Path = tuple[Any, ...]


def _walk(value: Any, path: Path, fn: Any) -> Any:
    """``value`` with every tensor leaf ``t`` replaced by ``fn(t, path)`` (containers rebuilt,
    tensors and other leaves untouched)."""
    if isinstance(value, torch.Tensor):
        return fn(value, path)
    if isinstance(value, Mapping):
        return {k: _walk(v, (*path, k), fn) for k, v in value.items()}
    if type(value) is list:
        return [_walk(v, (*path, i), fn) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_walk(v, (*path, i), fn) for i, v in enumerate(value))
    return value


def local_form(state: Any) -> tuple[Any, list[list[Any]]]:
    """``state`` with each DTensor leaf replaced by its local tensor (sharing its memory), and
    the paths of those leaves (lists of keys, in the state's order)."""
    paths: list[list[Any]] = []

    def local(t: torch.Tensor, path: Path) -> torch.Tensor:
        if not is_dtensor(t):
            return t
        _refuse_partial(t, path)
        paths.append(list(path))
        out: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return out.detach()

    return _walk(state, (), local), paths


def _optimizers(objects: Mapping[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Each registered optimizer's parameters, in the order its ``state_dict()`` numbers them."""
    return {
        name: [p for group in obj.param_groups for p in group["params"]]
        for name, obj in objects.items()
        if isinstance(obj, torch.optim.Optimizer)
    }


class Targets:
    """Where each DTensor leaf of a state goes on this rank: the objects' own DTensor leaves
    by path (``("objects", name, *key)``), and for ``("objects", optimizer, "state", i, ...)``
    the optimizer's ``i``-th parameter."""

    def __init__(self, objects: Mapping[str, Any]) -> None:
        self.own: dict[Path, torch.Tensor] = {}
        self.params = _optimizers(objects)
        for name, obj in objects.items():
            _walk(obj.state_dict(), ("objects", name), self._collect)

    def _collect(self, t: torch.Tensor, path: Path) -> torch.Tensor:
        if is_dtensor(t):
            self.own[path] = t
        return t

    def get(self, path: Path) -> torch.Tensor | None:
        if path in self.own:
            return self.own[path]
        if len(path) >= 4 and path[1] in self.params and path[2] == "state":
            params, index = self.params[path[1]], path[3]
            if type(index) is int and 0 <= index < len(params) and is_dtensor(params[index]):
                return params[index]
        return None

    def signature(self) -> str:
        """The global shape and this rank's box of every DTensor the state is built on, as
        canonical JSON ("" when there is none): equal on the ranks that hold the same shards.
        An optimizer's own state leaves are left out (they mirror its parameters, which are
        in, and a fresh optimizer has none yet)."""
        rows: list[Any] = []
        for path, t in self.own.items():
            if path[1] in self.params and len(path) > 2 and path[2] == "state":
                continue
            rows.append([list(path), *_box(t, path)])
        for name, params in self.params.items():
            rows += [
                [["param", name, i], *_box(p, ("objects", name, "param", i))]
                for i, p in enumerate(params)
                if is_dtensor(p)
            ]
        return json.dumps(rows, sort_keys=True, default=str) if rows else ""


def _refuse_partial(t: torch.Tensor, path: Path) -> None:
    spec: Any = t
    if any(p.is_partial() for p in spec.placements):
        where = ".".join(str(k) for k in path[1:])
        raise ConfigError(
            f"live state {where} is a DTensor with a Partial placement {tuple(spec.placements)}: "
            "its local values are not the tensor's until they are reduced; keep only "
            "Shard and Replicate placements in the state between updates"
        )


def _box(t: torch.Tensor, path: Path) -> list[Any]:
    _refuse_partial(t, path)
    box = dtensor_box(t)
    return [list(t.shape), list(box.offsets), list(box.sizes), str(t.dtype)]


def signature(objects: Mapping[str, Any]) -> str:
    """:meth:`Targets.signature` of ``objects``."""
    return Targets(objects).signature()


def install(state: Any, paths: Any, targets: Targets) -> tuple[Any, str | None]:
    """``state`` (a local form) with the leaves at ``paths`` made DTensors on this rank's
    targets, ready for ``load_state_dict``; or None and why not (a path nobody here has a
    DTensor for, a local shape that differs from this rank's shard)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        return None, "malformed list of sharded leaves"
    wanted = {tuple(p) for p in paths}
    problems: list[str] = []
    found: set[Path] = set()

    def shard(t: torch.Tensor, path: Path) -> torch.Tensor:
        if path not in wanted:
            return t
        found.add(path)
        like = targets.get(path)
        mine = None if like is None else like.to_local()  # type: ignore[attr-defined]
        if like is None or mine is None or tuple(mine.shape) != tuple(t.shape):
            where = ".".join(str(k) for k in path[1:])
            have = "no DTensor" if mine is None else f"a local shard of {tuple(mine.shape)}"
            problems.append(f"{where}: a shard of {tuple(t.shape)} arrived, this rank has {have}")
            return t
        spec: Any = like
        out: torch.Tensor = DTensor.from_local(
            t, spec.device_mesh, spec.placements, shape=like.shape, stride=like.stride()
        )
        return out

    out = _walk(state, (), shard)
    if not problems and found != wanted:
        problems.append(f"{len(wanted - found)} sharded leaves missing from the state")
    if problems:
        return None, "; ".join(problems[:3])
    return out, None
