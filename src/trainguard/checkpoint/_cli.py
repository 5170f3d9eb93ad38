"""``trainguard ckpt``: list, verify and show checkpoints on disk.

Understands the three layouts trainguard writes:

- a single-process checkpoint file (safetensors-compatible, or ``format="torch"``);
- a multi-rank checkpoint directory (``rankNNNNN.*`` parts and a ``COMMITTED`` marker);
- a local-checkpoint root (``iter_NNNNNNNNNNNN/ownerNNNNN.hNNNNN.safetensors`` parts and replicas).

Sharded (DTensor) tensors, whose chunks lie in several parts, are shown and checked across the
parts of one directory.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

from trainguard.checkpoint import _cli_shards
from trainguard.checkpoint._regular import regular_only
from trainguard.checkpoint.format.kinds import ZIP_MAGIC, is_torch_file
from trainguard.errors import CheckpointError

_MARKER = "COMMITTED"  # checkpoint._commit.MARKER, kept here so `ls` does not import torch
_ITER = re.compile(r"^iter_(\d{12})$")
_PART = re.compile(r"^(rank\d{5}|owner\d{5}\.h\d{5})\.(safetensors|pt)$")


def _escape(text: str) -> str:
    """``text`` with every non-printable character (terminal escape sequences, newlines, bidi
    controls) written as a Python escape: names come from files nobody vouches for."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _out(line: str, *, err: bool = False) -> None:
    print(_escape(line), file=sys.stderr if err else sys.stdout)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _parts(path: Path) -> list[Path]:
    """Every checkpoint file at or under ``path`` (never ``.tmp`` files), sorted."""
    return _scan(path)[0]


def _scan(path: Path) -> tuple[list[Path], list[str]]:
    """:func:`_parts`, and what under ``path`` could not be read: a directory that cannot be
    listed, an entry whose target is gone (a dangling or looping link), a file named like a
    checkpoint file that is not a regular file (a FIFO, a device). Symlinked directories are
    not entered (as before)."""
    if path.is_file():
        return [path], []
    parts: list[Path] = []
    problems: list[str] = []

    def unreadable(exc: OSError) -> None:
        problems.append(f"{exc.filename}: cannot be read ({exc.strerror or exc})")

    for directory, _, names in os.walk(path, onerror=unreadable):
        for name in names:
            entry = Path(directory, name)
            try:
                mode = entry.stat().st_mode
            except OSError as exc:
                problems.append(f"{entry}: cannot be read ({exc.strerror or exc})")
                continue
            if entry.suffix not in (".safetensors", ".pt"):
                continue
            if stat.S_ISREG(mode):
                parts.append(entry)
            else:
                problems.append(f"{entry}: not a regular file (a FIFO, device or socket)")
    return sorted(parts), problems


def _describe(entry: Path) -> tuple[str, str, int] | None:
    """(kind, status, number of parts) of one entry of a root, or None if it is no checkpoint."""
    if entry.is_file():
        if entry.name.endswith(".tmp"):
            return "file", "incomplete (.tmp)", 0
        if entry.suffix not in (".safetensors", ".pt") and not _looks_like_checkpoint(entry):
            return None
        problem = _check(entry, allow_pickle=True, unpickle=False)
        return "file", "complete" if problem is None else "corrupt", 1
    if entry.is_dir() and _ITER.match(entry.name):
        parts = _parts(entry)
        owners = {p.name[5:10] for p in parts}
        return "local", f"{len(owners)} owners, {len(parts)} copies", len(parts)
    if entry.is_dir():
        parts = [p for p in _parts(entry) if p.parent == entry]
        if not parts:
            return None
        status = "committed" if (entry / _MARKER).exists() else "uncommitted"
        return "ranks", status, len(parts)
    return None


def _looks_like_checkpoint(path: Path) -> bool:
    try:
        with open(path, "rb", opener=regular_only) as f:
            head = f.read(16)
    except (OSError, CheckpointError):
        return False
    return head.startswith(ZIP_MAGIC) or (len(head) > 9 and head[8:9] == b"{")


def _check(path: Path, *, allow_pickle: bool, unpickle: bool) -> str | None:
    """None if ``load`` would accept the file, else what is wrong: the header's fields, every
    checksum, the skeleton against the entries. Pickled leaves are accepted only with
    ``allow_pickle`` and never unpickled; a ``format="torch"`` file is unpickled with torch's
    ``weights_only`` unless ``unpickle`` (``--allow-pickle``: files the user trusts)."""
    from trainguard.checkpoint.format.read import check_file, read_header

    try:
        if is_torch_file(path):
            import torch

            torch.load(path, weights_only=not unpickle, mmap=True)
            return None
        if not read_header(path).is_trainguard:
            return "a safetensors file without trainguard metadata (no checksums to verify)"
        check_file(path, allow_pickle=allow_pickle)
        return None
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{path}: ")
    except Exception as exc:  # torch.load of a damaged zip, an unreadable file
        return f"{type(exc).__name__}: {exc}"


def cmd_ls(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.exists():
        _out(f"no such directory: {root}", err=True)
        return 1
    entries = [root] if root.is_file() or _ITER.match(root.name) else sorted(root.iterdir())
    rows = []
    for entry, name in _entries(root, entries):
        described = _describe(entry)
        if described is not None:
            kind, status, parts = described
            rows.append((_escape(name), kind, status, str(parts), _human(_size(entry))))
    if not rows:
        _out(f"no checkpoints under {root}", err=True)
        return 1
    headers = ("NAME", "KIND", "STATUS", "PARTS", "SIZE")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        _out("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _entries(root: Path, entries: list[Path]) -> list[tuple[Path, str]]:
    """``entries`` with the names ``ls`` shows; a subdirectory that is itself a local-checkpoint
    root (``iter_*`` directories in it: one node's root, as ``RUN/local/node0`` of the demo) is
    replaced by its iterations, named ``node0/iter_...``."""
    found: list[tuple[Path, str]] = []
    for entry in entries:
        inner = []
        if entry != root and entry.is_dir() and not entry.is_symlink():
            inner = sorted(d for d in entry.iterdir() if d.is_dir() and _ITER.match(d.name))
        if inner:
            found.extend((d, f"{entry.name}/{d.name}") for d in inner)
        else:
            found.append((entry, entry.name))
    return found


def _is_rank_dir(directory: Path) -> bool:
    return any(p.name.startswith("rank") and _PART.match(p.name) for p in directory.iterdir())


def cmd_verify(args: argparse.Namespace) -> int:
    path = Path(args.path)
    parts, unreadable = _scan(path) if path.exists() else ([], [])
    if not parts and not unreadable:
        _out(f"no checkpoint files at {path}", err=True)
        return 1
    for line in unreadable:
        _out(f"FAIL {line}")
    bad = len(unreadable)
    failed: set[Path] = set()
    for part in parts:
        problem = _check(part, allow_pickle=args.allow_pickle, unpickle=args.allow_pickle)
        if problem is not None:
            failed.add(part)
            bad += 1
        _out(
            f"{'OK  ' if problem is None else 'FAIL'} {part}" + (f": {problem}" if problem else "")
        )
    uncommitted = 0
    for directory in sorted({p.parent for p in parts if _PART.match(p.name)}):
        if _is_rank_dir(directory) and not (directory / _MARKER).exists():
            why = (
                f"no {_MARKER} marker: a save that did not finish (cut by a crash or a kill, or "
                "still being written); load refuses it unless allow_uncommitted=True"
            )
            if directory.resolve() == path.resolve():  # the checkpoint asked about
                _out(f"FAIL {directory}: uncommitted, {why}")
                bad += 1
            else:  # one save among several under a root: the committed ones are what counts
                _out(f"UNCOMMITTED {directory}: {why}; not counted as a problem")
                uncommitted += 1
        for problem in _cli_shards.problems(directory, parts, lambda p: p not in failed):
            _out(f"FAIL {directory}: {problem}")
            bad += 1
    summary = (
        f"{bad} problem(s) in {len(parts)} file(s)" if bad else f"{len(parts)} file(s) verified"
    )
    if uncommitted:
        summary += f"; {uncommitted} uncommitted save(s) ignored"
    _out(summary)
    return 1 if bad else 0


def cmd_show(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.format.read import read_header

    parts = _parts(Path(args.path)) if Path(args.path).exists() else []
    if not parts:
        _out(f"no checkpoint files at {args.path}", err=True)
        return 1
    part = parts[0]
    _out(f"{part}  ({_human(part.stat().st_size)})")
    try:
        if is_torch_file(part):
            import torch

            state = torch.load(part, weights_only=True, mmap=True)
            for key, value in _walk(state):
                _out(f"  {key:<40} {value}")
            return 0
        header = read_header(part)
        for other in parts[1:]:  # a part cut short or damaged fails here, not in a later load
            if not is_torch_file(other):
                read_header(other)
    except CheckpointError as exc:
        _out(f"cannot read {exc}; `trainguard ckpt verify {args.path}` checks every file", err=True)
        return 1
    except Exception as exc:  # torch.load of a damaged or truncated zip
        _out(f"cannot read {part}: {type(exc).__name__}: {str(exc).splitlines()[0]}", err=True)
        return 1
    meta = {k: v for k, v in header.metadata.items() if k not in ("skeleton", "checksums")}
    if meta:
        _out("  " + ", ".join(f"{k}={v}" for k, v in sorted(meta.items())))
    sharded, chunk_entries = _cli_shards.show(part, parts) if header.is_trainguard else ([], set())
    for name, (dtype, shape, begin, end) in header.entries.items():
        if name not in chunk_entries:
            _out(f"  {_escape(name):<40} {dtype:<6} {list(shape)!s:<20} {_human(end - begin)}")
    for line in sharded:
        _out(line)
    return 0


def _walk(node: object, prefix: str = "") -> list[tuple[str, str]]:
    import torch

    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _walk(v, f"{prefix}{k}.")]
    if isinstance(node, (list, tuple)):
        return [kv for i, v in enumerate(node) for kv in _walk(v, f"{prefix}{i}.")]
    if isinstance(node, torch.Tensor):
        return [(prefix[:-1], f"{node.dtype} {list(node.shape)}")]
    return [(prefix[:-1], repr(node)[:60])]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``trainguard ckpt ls|verify|show``."""
    p = sub.add_parser("ckpt", help="list, verify and show checkpoints", description=__doc__)
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = cmds.add_parser("ls", help="checkpoints under ROOT: kind, committed or not, parts, size")
    ls.add_argument("root", metavar="ROOT")
    ls.set_defaults(func=cmd_ls)
    verify = cmds.add_parser(
        "verify",
        help="check every part and replica at PATH, that a multi-rank checkpoint has all its "
        "parts and that the chunks of every sharded tensor cover it exactly once; exit status "
        "1 on any problem: a damaged or unreadable file, a missing part, PATH itself an "
        "uncommitted save. Under a ROOT of several checkpoints an uncommitted one (a save a "
        "crash cut short, which load refuses) is listed as UNCOMMITTED and is no problem",
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickled leaves (load needs allow_pickle=True for them); format='torch' "
        "files are then unpickled in full: only for files you trust",
    )
    verify.set_defaults(func=cmd_verify)
    show = cmds.add_parser(
        "show",
        help="the structure of a checkpoint: keys, dtypes, shapes; sharded tensors with their "
        "global shape, mesh, placements and the chunk each file holds",
    )
    show.add_argument("path", metavar="PATH")
    show.set_defaults(func=cmd_show)
