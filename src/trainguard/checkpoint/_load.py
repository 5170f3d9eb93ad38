"""Loading checkpoints written by AsyncCheckpointer, and finding the newest one.

Re-exported by :mod:`trainguard.checkpoint.async_save` and :mod:`trainguard.checkpoint`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint import _commit, _overwrite
from trainguard.checkpoint._regular import regular_only
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.kinds import FORMATS, is_torch_file
from trainguard.checkpoint.format.read import FileHeader, load_file, read_header
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointUncommittedError,
)


def part_name(rank: int, format: str) -> str:
    """File name of one rank's part inside a multi-rank checkpoint directory; ``format`` is
    one of :data:`FORMATS`, as given to ``save``."""
    return f"rank{rank:05d}" + (".pt" if format == "torch" else ".safetensors")


def _marker(marker: str) -> dict[str, Any]:
    """The commit marker's fields; :class:`CheckpointCorruptError` if it is not what
    :mod:`._commit` writes (a JSON object whose ``world_size``, if present, is a count)."""
    with open(marker, "rb", opener=regular_only) as f:
        raw = f.read(1 << 20)
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        info = None
    size = info.get("world_size", 1) if isinstance(info, dict) else None
    if type(size) is not int or size < 1:
        raise CheckpointCorruptError(
            f"{marker}: malformed commit marker; the checkpoint is damaged, load an older one"
        )
    return dict(info) if isinstance(info, dict) else {}


def _torch_load(file: str, allow_pickle: bool) -> Any:
    """``torch.load`` of a ``format="torch"`` file; a damaged one is a corrupt checkpoint."""
    try:
        return torch.load(file, weights_only=not allow_pickle, mmap=True)
    except OSError:
        raise
    except Exception as exc:  # a damaged zip, a truncated pickle, a global not allowed
        hint = "" if allow_pickle else " (if it holds pickled objects: allow_pickle=True)"
        raise CheckpointCorruptError(
            f"{file}: torch.load failed{hint}: {type(exc).__name__}: {exc}"
        ) from exc


def _resolve(path: str, rank: int | None, allow_uncommitted: bool) -> str:
    _overwrite.settle(path)  # an overwrite a crash interrupted
    if not os.path.isdir(path):
        if not os.path.exists(path):
            hint = (
                " (only a .tmp file exists: that save never completed)"
                if os.path.exists(path + ".tmp") or tmpfile.leftovers(path)
                else ""
            )
            raise CheckpointError(f"no checkpoint at {path}{hint}")
        return path
    marker = os.path.join(path, _commit.MARKER)
    info: dict[str, Any] = {}
    if os.path.exists(marker):
        info = _marker(marker)
    elif not allow_uncommitted:
        raise CheckpointUncommittedError(
            f"{path} has no {_commit.MARKER} marker: not every rank's part became durable; "
            "load an older checkpoint, or pass allow_uncommitted=True"
        )
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        elif info.get("world_size", 1) == 1:
            rank = 0
        else:
            raise CheckpointError(
                f"{path} holds {info['world_size']} ranks' parts; pass rank= to choose one"
            )
    for fmt in FORMATS:
        file = os.path.join(path, part_name(rank, fmt))
        if os.path.exists(file):
            return file
    raise CheckpointError(f"{path} has no part for rank {rank}")


def _this_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _parts(path: str, allow_uncommitted: bool) -> dict[int, str]:
    """Every part of the checkpoint at ``path``: ``{0: path}`` for a file."""
    if not os.path.isdir(path):
        return {0: _resolve(path, 0, allow_uncommitted)}
    _resolve(path, 0, allow_uncommitted)  # the marker's checks
    marker = os.path.join(path, _commit.MARKER)
    world = _marker(marker)["world_size"] if os.path.exists(marker) else None
    parts = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("rank") and name.endswith(".pt"):
            raise CheckpointError(
                f"{path} was saved with format='torch'; load(..., into=) reads only "
                "format='trainguard' checkpoints (load it without into=)"
            )
        number = name.removeprefix("rank").removesuffix(".safetensors")
        if name != number and number.isdigit() and name == part_name(int(number), "trainguard"):
            parts[int(number)] = os.path.join(path, name)
    missing = [r for r in range(world or 0) if r not in parts]
    if missing:
        raise CheckpointCorruptError(f"{path}: the parts of ranks {missing[:8]} are missing")
    return parts


def _load_into(
    path: str, into: Any, rank: int | None, verify: bool, allow_pickle: bool, uncommitted: bool
) -> Any:
    """``load(path, into=)``: every part's header, then only the chunks ``into`` overlaps."""
    from trainguard.checkpoint._reshard import Index, file_reader, fill

    started = time.monotonic()
    parts = _parts(path, uncommitted)
    headers = {}
    for part, file in parts.items():
        headers[part] = read_header(file)
        if not headers[part].is_trainguard:
            raise CheckpointCorruptError(f"{file}: not a trainguard file")
    index = Index.from_headers(headers)
    index.refuse_bad_cover(path)
    me = _this_rank(rank)
    plain_part = me if me in parts else 0
    stats = fill(
        into,
        index,
        file_reader(parts, verify=verify),
        plain_part=plain_part,
        allow_pickle=allow_pickle,
    )
    events.emit(
        "ckpt_load",
        duration=time.monotonic() - started,
        bytes=stats.bytes_read,
        chunks=stats.chunks_read,
        parts=sorted(stats.parts_read),
        path=path,
        verified=verify,
        source="file",
    )
    return into


def load(
    path: str | os.PathLike[str],
    *,
    into: Any = None,
    rank: int | None = None,
    verify: bool = True,
    allow_pickle: bool = False,
    allow_uncommitted: bool = False,
) -> Any:
    """Load a checkpoint written by :class:`AsyncCheckpointer`; returns the nested state.

    ``path`` is a file (single process) or a multi-rank directory, of which this rank's part is
    loaded (``rank`` defaults to the torch.distributed rank). Tensors are views of a private
    memory map of the file. ``verify`` checks every tensor's checksum. Refuses a directory without
    a commit marker unless ``allow_uncommitted``. ``format="torch"`` files are read with
    ``torch.load(weights_only=not allow_pickle, mmap=True)``.

    ``into`` (a state of the saved structure) is filled in place and returned: how a sharded
    checkpoint (DTensors) is loaded, into any sharding and any number of ranks. Each rank (or
    a single process) calls it on its own, no collective: it reads every part's header, then
    only the byte ranges of the saved chunks that overlap its target tensors (a DTensor's local
    shard; a plain tensor whole), each chunk's checksum verified. Plain tensors and other
    values come from this rank's part (part 0 when this rank did not exist at save). A single
    process consolidates a sharded checkpoint with ``into={"w": torch.empty(global_shape)}``.
    """
    if into is not None:
        return _load_into(os.fspath(path), into, rank, verify, allow_pickle, allow_uncommitted)
    started = time.monotonic()
    file = _resolve(os.fspath(path), rank, allow_uncommitted)
    if is_torch_file(file):
        state = _torch_load(file, allow_pickle)
    else:
        state, _ = load_file(file, verify=verify, allow_pickle=allow_pickle)
    events.emit(
        "ckpt_load",
        duration=time.monotonic() - started,
        bytes=os.path.getsize(file),
        path=os.fspath(path),
        verified=verify,
        source="file",
    )
    return state


def _committed_time(entry: Path) -> float | None:
    """mtime of a complete checkpoint at ``entry`` (file or committed directory), else None."""
    try:
        if entry.is_dir():
            return (entry / _commit.MARKER).stat().st_mtime
        if entry.name.endswith(".tmp"):
            return None
        if not is_torch_file(entry):
            header: FileHeader = read_header(entry)
            if not header.is_trainguard:
                return None
        return entry.stat().st_mtime
    except (OSError, CheckpointError, ValueError):
        return None


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly under ``root`` (a committed directory or a whole
    checkpoint file; ``.tmp`` files never count), or None. Newest = latest commit time."""
    root = Path(root)
    if not root.is_dir():
        return None
    _overwrite.settle_root(str(root))  # overwrites a crash interrupted
    found = [
        (t, p.name, p)
        for p in root.iterdir()
        if not _overwrite.is_leftover(p.name) and (t := _committed_time(p)) is not None
    ]
    return max(found)[2] if found else None
