"""Health probes: what a quarantined host must pass before it is let back into the job.

A probe is a callable ``RoundState -> object`` that raises when the host is not healthy (the
Wrapper's ``health_check`` hooks are probes too). The built-in ones:

- :class:`MatmulProbe`: a small matrix product on the rank's device (its CUDA device when
  there is one, else the CPU), checked against the result known in closed form;
- :class:`FsyncProbe`: write a file under a directory (the local checkpoint root), ``fsync``
  it, read it back, delete it;
- :class:`FreeSpaceProbe`: at least ``min_free`` bytes free on a file system (the local
  checkpoint root, ``/dev/shm``).

:func:`run_probes` runs them in order, each in a thread bounded by ``timeout``: a probe that
raises or does not return in time fails, and the host stays out. A probe that hangs leaves its
(daemon) thread behind; a quarantined host is not trusted anyway, and the thread ends with the
process.

Which ranks call them: each rank of a quarantined host, before each barrier while its host is
out (:class:`~trainguard.restart.quarantine.Quarantine`).
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainguard.errors import ConfigError

__all__ = ["FreeSpaceProbe", "FsyncProbe", "MatmulProbe", "run_probes"]

#: a probe: raises when the host is not healthy.
Probe = Callable[[Any], object]


class MatmulProbe:
    """``A @ B`` on the rank's device for ``A = i + 1`` (row index) and ``B`` all ones, of size
    ``n``: every entry of row ``i`` must be ``n * (i + 1)`` exactly (small integers are exact in
    float32). A GPU that computes wrong numbers, or whose kernels fail, fails it."""

    def __init__(self, n: int = 64) -> None:
        if type(n) is not int or not 1 <= n <= 4096:
            raise ConfigError(f"MatmulProbe(n={n!r}): pass an int from 1 to 4096")
        self.n = n

    def __call__(self, state: object = None) -> None:
        import torch

        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
        n = self.n
        rows = torch.arange(1, n + 1, dtype=torch.float32, device=device)
        a = rows.unsqueeze(1).expand(n, n).contiguous()
        b = torch.ones(n, n, dtype=torch.float32, device=device)
        got = (a @ b).cpu()
        want = (rows.cpu() * n).unsqueeze(1).expand(n, n)
        if not torch.equal(got, want):
            bad = int((got != want).sum())
            raise RuntimeError(f"MatmulProbe: {bad} of {n * n} entries wrong on {device}")

    def __repr__(self) -> str:
        return f"MatmulProbe({self.n})"


class FsyncProbe:
    """Write ``size`` bytes to a new file under ``root``, ``fsync`` it, read it back, delete it."""

    def __init__(self, root: str | os.PathLike[str], size: int = 1 << 20) -> None:
        if type(size) is not int or size < 1:
            raise ConfigError(f"FsyncProbe(size={size!r}): pass an int >= 1 (bytes)")
        self.root = Path(root)
        self.size = size

    def __call__(self, state: object = None) -> None:
        path = self.root / f".trainguard-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        data = os.urandom(self.size)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if path.read_bytes() != data:
                raise OSError(f"FsyncProbe: {path} read back different bytes")
        finally:
            path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"FsyncProbe({str(self.root)!r})"


class FreeSpaceProbe:
    """At least ``min_free`` bytes free on the file system that holds ``path``."""

    def __init__(self, path: str | os.PathLike[str], min_free: int = 1 << 30) -> None:
        if type(min_free) is not int or min_free < 0:
            raise ConfigError(f"FreeSpaceProbe(min_free={min_free!r}): pass an int >= 0 (bytes)")
        self.path = Path(path)
        self.min_free = min_free

    def __call__(self, state: object = None) -> None:
        free = shutil.disk_usage(self.path).free
        if free < self.min_free:
            raise OSError(
                f"FreeSpaceProbe: {free} bytes free on {self.path}, fewer than {self.min_free}"
            )

    def __repr__(self) -> str:
        return f"FreeSpaceProbe({str(self.path)!r}, {self.min_free})"


def run_probes(probes: Sequence[Probe], state: object, *, timeout: float) -> str:
    """Run ``probes`` in order on ``state``: "ok" when each returned within ``timeout`` seconds,
    else what the first failing one did (raised, or did not return in time)."""
    for probe in probes:
        failure = _run_one(probe, state, timeout)
        if failure is not None:
            return failure
    return "ok"


def _run_one(probe: Probe, state: object, timeout: float) -> str | None:
    error: list[BaseException] = []

    def target() -> None:
        try:
            probe(state)
        except BaseException as exc:  # a probe's SystemExit is its failure, not this rank's end
            error.append(exc)

    thread = threading.Thread(target=target, name="trainguard-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"{probe!r} did not return within {timeout:g} s"
    if error:
        return f"{probe!r} raised {type(error[0]).__qualname__}: {error[0]}"
    return None
