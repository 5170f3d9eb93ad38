"""Conversions between trainguard's DCP checkpoints and single ``torch.save`` files.

DCP's own ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads with DCP's
``FileSystemReader``, which cannot read trainguard's files; these two functions are the same
conversions through :class:`~trainguard.checkpoint.dcp.StorageReader` and
:class:`~trainguard.checkpoint.dcp.StorageWriter`. Both run in one process, without a process
group.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainguard.checkpoint.dcp.storage_reader import StorageReader
from trainguard.checkpoint.dcp.storage_writer import StorageWriter
from trainguard.errors import CheckpointCorruptError

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike[str],
    torch_save_path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
) -> None:
    """Write the whole state of the trainguard DCP checkpoint at ``dcp_checkpoint_dir`` (every
    tensor unsharded, nesting as saved) into one ``torch.save`` file at ``torch_save_path``.

    Values that are not tensors are read as :class:`StorageReader` reads them
    (``allow_pickle`` as there)."""
    reader = StorageReader(dcp_checkpoint_dir, allow_pickle=allow_pickle)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # a bytes item: DCP's planner puts the loaded value here
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    torch.save(_nest(flat, metadata), os.fspath(torch_save_path))


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike[str],
    dcp_checkpoint_dir: str | os.PathLike[str],
    *,
    weights_only: bool = True,
) -> None:
    """Save the state in the ``torch.save`` file ``torch_save_path`` as a trainguard DCP
    checkpoint at ``dcp_checkpoint_dir`` (``weights_only=False`` only for files you trust)."""
    state = torch.load(os.fspath(torch_save_path), weights_only=weights_only)
    with StorageWriter(dcp_checkpoint_dir) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)


def _nest(flat: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """``flat`` in the nesting DCP's planner flattened (its ``planner_data``: fqn -> path)."""
    paths = metadata.planner_data
    if not isinstance(paths, dict) or not paths:
        return flat
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        if not isinstance(path, (tuple, list)) or not path:
            raise CheckpointCorruptError(f"the metadata's path of {fqn!r} is {path!r}")
        node: Any = out
        for key, nxt in itertools.pairwise(path):
            node = _child(node, key, [] if isinstance(nxt, int) else {})
        _put(node, path[-1], value)
    return out


def _child(node: Any, key: Any, empty: Any) -> Any:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
    node[key] = value
