"""The warm worker's own side: a process past its imports that becomes a worker on demand.

The agent starts ``python -u -m trainguard.launch._warmboot AGENT_PID READY_FD KIND TARGET`` in
a session of its own (:mod:`trainguard.launch._warm`). The process

1. asks the kernel for ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``) and exits at once
   when its parent is already not ``AGENT_PID`` (the agent died before the ``prctl``);
2. imports torch, ``torch.distributed``, :mod:`trainguard.restart` and the top-level imports of
   the user's script (``KIND`` ``script``; only modules found outside the script's folder and
   the working directory, which are the user's own and may act on import) or module
   (``module``: its package's imports are not guessed), then writes one byte to ``READY_FD``;
3. blocks on one JSON line on its stdin: ``{"env", "argv", "stdout", "stderr"}``. At end of
   file (the agent closed it, or died) it exits 0 without running anything.

Then it becomes the worker: the environment is replaced by ``env`` (torch's worker
environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``, ``TORCHELASTIC_*``,
``TRAINGUARD_*``), stdout/stderr go to the files named (``None``: the inherited ones, torch's
console), stdin becomes ``/dev/null``, the parent-death signal is cleared (a cold worker does
not die with its agent either), and ``argv`` (what follows ``python -u``: ``script args...`` or
``-m module args...``) runs as ``__main__`` through :mod:`runpy`, with ``sys.argv`` and
``sys.path[0]`` as the interpreter would have set them. Its exit status is the script's.

What differs from a cold start: modules imported in step 2 read their environment at import
time with the node's environment (the same on every rank), not the rank's.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import runpy
import signal
import sys
from pathlib import Path

__all__ = ["become", "main", "prefetch", "script_imports"]

_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def script_imports(script: str) -> list[str]:
    """Top-level absolute imports of ``script`` (first components, in order, no repeats)."""
    try:
        tree = ast.parse(Path(script).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        names += [n for n in found if n not in names]
    return names


def _outside(name: str, folders: list[Path]) -> bool:
    """``name`` is found, and not inside one of ``folders`` (the user's own code)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = spec.origin if spec.has_location else None
    if origin is None:
        return True  # built-in or frozen
    where = Path(origin).resolve()
    return not any(where.is_relative_to(f) for f in folders)


def prefetch(kind: str, target: str) -> list[str]:
    """Import what the worker will import anyway; returns the names imported."""
    done = []
    for name in ("torch", "torch.distributed", "trainguard.restart"):
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # a worker that cannot import them fails the same way when it runs
            pass
    if kind != "script":
        return done
    folders = [Path(target).resolve().parent, Path.cwd().resolve()]
    for name in script_imports(target):
        if name in sys.modules or not _outside(name.split(".")[0], folders):
            continue
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:
            pass
    return done


def _redirect(path: str | None, fd: int) -> None:
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def become(order: dict[str, object]) -> None:
    """Turn this process into the worker ``order`` describes (the module docstring); returns
    when its ``__main__`` returned, raises what it raised (``SystemExit`` included)."""
    env = order["env"]
    argv = order["argv"]
    assert isinstance(env, dict) and isinstance(argv, list)
    _redirect(order.get("stdout"), 1)  # type: ignore[arg-type]
    _redirect(order.get("stderr"), 2)  # type: ignore[arg-type]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    _pdeathsig(0)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(str(argv[1]), run_name="__main__", alter_sys=True)
    else:
        script = str(argv[0])
        sys.argv = [script, *map(str, argv[1:])]
        sys.path[0] = str(Path(script).resolve().parent)
        runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> int:
    agent, ready_fd, kind, target = int(argv[0]), int(argv[1]), argv[2], argv[3]
    _pdeathsig(signal.SIGKILL)
    if os.getppid() != agent:  # the agent died before the prctl
        return 0
    prefetch(kind, target)
    with contextlib.suppress(OSError):  # taken over before it was ready: nobody listens
        os.write(ready_fd, b"r")
    os.close(ready_fd)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
