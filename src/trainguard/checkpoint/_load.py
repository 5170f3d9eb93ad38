"""Loading checkpoints written by AsyncCheckpointer, and finding the newest one.

Re-exported by :mod:`trainguard.checkpoint.async_save` and :mod:`trainguard.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint import _commit, _overwrite
from trainguard.checkpoint._regular import open_regular
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.kinds import FORMATS, is_torch_file
from trainguard.checkpoint.format.read import (
    FileHeader,
    header_of,
    load_file,
    open_file,
    read_header,
)
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointUncommittedError,
)


def part_name(rank: int, format: str) -> str:
    """File name of one rank's part inside a multi-rank checkpoint directory; ``format`` is
    one of :data:`FORMATS`, as given to ``save``."""
    return f"rank{rank:05d}" + (".pt" if format == "torch" else ".safetensors")


#: Attempts of a load whose directory was replaced while it was read (see :func:`_retrying`).
_ATTEMPTS = 8


def _marker(marker: str, dir_fd: int | None = None) -> dict[str, Any]:
    """The commit marker's fields; :class:`CheckpointCorruptError` if it is not what
    :mod:`._commit` writes (a JSON object whose ``world_size``, if present, is a count, and
    whose ``save_id``, if present, a string). ``dir_fd``: read ``MARKER`` in that directory."""
    fd = open_regular(marker if dir_fd is None else _commit.MARKER, dir_fd=dir_fd)
    with open(fd, "rb") as f:
        raw = f.read(1 << 20)
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        info = None
    size = info.get("world_size", 1) if isinstance(info, dict) else None
    save_id = info.get("save_id", "") if isinstance(info, dict) else None
    if type(size) is not int or size < 1 or not isinstance(save_id, str):
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


@dataclasses.dataclass
class _Opened:
    """A checkpoint opened once: a file (``fd`` None), or a directory read only through its
    descriptor ``fd``, so that its marker and parts come from one directory even while a
    save swaps another one in under its name (``info``: its marker's fields, None without)."""

    path: str
    fd: int | None
    info: dict[str, Any] | None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def has(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def check_part(self, header: FileHeader, expected: str | None) -> str | None:
        """:class:`CheckpointCorruptError` unless the part's save id is ``expected`` (None:
        take this part's); returns the id. A marker without one (a checkpoint written before
        save ids) checks nothing, nor does a DCP checkpoint's (its parts carry none: the
        metadata beside the marker names them)."""
        info = self.info or {}
        if self.info is not None and (not info.get("save_id") or info.get("format") == "dcp"):
            return None
        found = header.metadata.get("save_id")
        if expected is None:
            return found
        if found != expected:
            raise CheckpointCorruptError(
                f"{header.path}: written by save {found or '(none)'}, but the checkpoint is "
                f"save {expected}: parts of two saves were put together; the checkpoint is "
                "damaged, load an older one"
            )
        return found


def _open(path: str, allow_uncommitted: bool) -> _Opened:
    """The checkpoint at ``path``, opened once (see :class:`_Opened`); the caller closes it."""
    _overwrite.settle(path)  # an overwrite a crash interrupted (or two renames under way)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        return _Opened(path, None, None)
    except FileNotFoundError:
        hint = (
            " (only a .tmp file exists: that save never completed)"
            if os.path.exists(path + ".tmp") or tmpfile.leftovers(path)
            else ""
        )
        raise CheckpointError(f"no checkpoint at {path}{hint}") from None
    opened = _Opened(path, fd, None)
    try:
        if opened.has(_commit.MARKER):
            opened.info = _marker(opened.file(_commit.MARKER), fd)
        elif not allow_uncommitted:
            raise CheckpointUncommittedError(
                f"{path} has no {_commit.MARKER} marker: not every rank's part became durable; "
                "load an older checkpoint, or pass allow_uncommitted=True"
            )
    except BaseException:
        opened.close()
        raise
    return opened


def _replaced(path: str, opened: _Opened | None) -> bool:
    """Whether the directory at ``path`` is no longer the one ``opened`` read (a save swapped
    another one in, or two renames are under way and there is none); ``opened`` still open."""
    if opened is None or opened.fd is None:
        return opened is None
    try:
        now, then = os.stat(path), os.fstat(opened.fd)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)


def _retrying(path: str, allow_uncommitted: bool, read: Callable[[_Opened], Any]) -> Any:
    """``read`` of the checkpoint at ``path`` opened once; again (at most :data:`_ATTEMPTS`
    times) when it failed because a save replaced the directory while it was read (the old
    one is removed right after the swap): a reader never reports a checkpoint missing or
    damaged because it raced an overwrite."""
    for attempt in range(_ATTEMPTS):
        last = attempt + 1 == _ATTEMPTS
        try:
            opened = _open(path, allow_uncommitted)
        except (OSError, CheckpointError):  # gone, or replaced while its marker was read
            if last:
                raise
            continue
        try:
            return read(opened)
        except (OSError, CheckpointError):
            if last or not _replaced(path, opened):
                raise
        finally:
            opened.close()
    raise AssertionError("unreachable")


def _rank_of(opened: _Opened, rank: int | None) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    info = opened.info or {}
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if info.get("world_size", 1) == 1:
        return 0
    raise CheckpointError(
        f"{opened.path} holds {info['world_size']} ranks' parts; pass rank= to choose one"
    )


def _this_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _parts(opened: _Opened) -> dict[int, str]:
    """Every part of the opened checkpoint (names in its directory): ``{0: path}`` for a file."""
    if opened.fd is None:
        return {0: opened.path}
    world = opened.info["world_size"] if opened.info is not None else None
    parts = {}
    for name in sorted(os.listdir(opened.fd)):
        if name.startswith("rank") and name.endswith(".pt"):
            raise CheckpointError(
                f"{opened.path} was saved with format='torch'; load(..., into=) reads only "
                "format='trainguard' checkpoints (load it without into=)"
            )
        number = name.removeprefix("rank").removesuffix(".safetensors")
        if name != number and number.isdigit() and name == part_name(int(number), "trainguard"):
            parts[int(number)] = opened.file(name)
    missing = [r for r in range(world or 0) if r not in parts]
    if missing:
        raise CheckpointCorruptError(f"{opened.path}: the parts of ranks {missing[:8]} are missing")
    return parts


def _load_into(
    opened: _Opened, into: Any, rank: int | None, verify: bool, allow_pickle: bool
) -> Any:
    """``load(path, into=)``: every part's header, then only the chunks ``into`` overlaps."""
    from trainguard.checkpoint._reshard import Index, file_reader, fill

    started = time.monotonic()
    parts = _parts(opened)
    headers = {}
    expected = (opened.info or {}).get("save_id") or None
    fds: dict[int, int] = {}
    try:
        for part, file in parts.items():
            fds[part] = open_file(file, dir_fd=opened.fd)
            headers[part] = header_of(fds[part], file)
            if not headers[part].is_trainguard:
                raise CheckpointCorruptError(f"{file}: not a trainguard file")
            expected = opened.check_part(headers[part], expected)
        index = Index.from_headers(headers)
        index.refuse_bad_cover(opened.path)
        me = _this_rank(rank)
        plain_part = me if me in parts else 0
        stats = fill(
            into,
            index,
            file_reader(parts, verify=verify, fds=fds),
            plain_part=plain_part,
            allow_pickle=allow_pickle,
        )
    finally:
        for fd in fds.values():
            os.close(fd)
    events.emit(
        "ckpt_load",
        duration=time.monotonic() - started,
        bytes=stats.bytes_read,
        chunks=stats.chunks_read,
        parts=sorted(stats.parts_read),
        path=opened.path,
        verified=verify,
        source="file",
    )
    return into


def _load_one(
    opened: _Opened, rank: int | None, verify: bool, allow_pickle: bool
) -> tuple[Any, str]:
    """This rank's part of the opened checkpoint (the file itself for a file): its state and
    its path."""
    if opened.fd is None:
        file = opened.path
        if is_torch_file(file):
            return _torch_load(file, allow_pickle), file
        return load_file(file, verify=verify, allow_pickle=allow_pickle)[0], file
    me = _rank_of(opened, rank)
    for fmt in FORMATS:
        file = opened.file(part_name(me, fmt))
        if not opened.has(os.path.basename(file)):
            continue
        if fmt == "torch":  # torch.load maps a path: the one of this descriptor's entry
            fd = open_file(file, dir_fd=opened.fd)
            try:
                return _torch_load(f"/proc/self/fd/{fd}", allow_pickle), file
            finally:
                os.close(fd)
        state, header = load_file(file, verify=verify, allow_pickle=allow_pickle, dir_fd=opened.fd)
        opened.check_part(header, (opened.info or {}).get("save_id") or None)
        return state, file
    raise CheckpointError(f"{opened.path} has no part for rank {me}")


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
    path = os.fspath(path)
    if into is not None:
        return _retrying(
            path, allow_uncommitted, lambda o: _load_into(o, into, rank, verify, allow_pickle)
        )
    started = time.monotonic()
    state, file = _retrying(
        path, allow_uncommitted, lambda o: _load_one(o, rank, verify, allow_pickle)
    )
    events.emit(
        "ckpt_load",
        duration=time.monotonic() - started,
        bytes=_size(file),
        path=path,
        verified=verify,
        source="file",
    )
    return state


def _size(file: str) -> int:
    try:
        return os.path.getsize(file)
    except OSError:  # replaced since (what was loaded is mapped)
        return 0


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
    found: dict[str, float] = {}
    swapped: set[str] = set()  # names with swap siblings: a save may be swapping them now
    for p in root.iterdir():
        if (name := _overwrite.leftover_of(p.name)) is not None:
            swapped.add(name)
        elif (t := _committed_time(p)) is not None:
            found[p.name] = t
    for name in swapped - set(found):  # listed or looked at in the middle of a swap
        t = _swap_time(root / name)
        if t is not None:
            found[name] = t
    return root / max((t, name) for name, t in found.items())[1] if found else None


def _swap_time(path: Path) -> float | None:
    """The commit time of the checkpoint a swap of ``path`` is putting in place: the one at
    ``path`` by now, else the newest committed sibling (two renames between their steps)."""
    t = _committed_time(path)
    if t is None:
        t = _overwrite.sibling_time(str(path))
    return t if t is not None else _committed_time(path)
