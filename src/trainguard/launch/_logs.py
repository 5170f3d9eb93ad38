"""Worker log files and environment: torch's ``LogsSpecs``, extended for respawns.

:class:`AgentLogsSpecs` wraps the ``LogsSpecs`` torchrun built from ``--log-dir``,
``--redirects``, ``--tee`` (or ``--logs-specs``). torch calls its ``reify(envs)`` with each
worker's environment just before the workers start; the wrapper lets the wrapped one decide the
files, then adds the agent's variables (``TRAINGUARD_*``) to each worker's environment and
remembers which streams are tee'd. :func:`incarnation_files` gives a respawned process files
of its own under ``<local_rank>/inc_<k>/`` (torch's handler opens log files with mode ``"w"``;
reusing the first ones would erase the dead process's output).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from trainguard.launch._compat import WorkerLaunch

__all__ = ["AgentLogsSpecs", "IncarnationFiles", "incarnation_files", "tail"]


class AgentLogsSpecs(LogsSpecs):
    """Delegates to ``inner``; adds :attr:`extra_env` to every worker's environment."""

    def __init__(self, inner: LogsSpecs) -> None:
        super().__init__()
        self.inner = inner
        self.extra_env: dict[str, str] = {}
        self.dest = LogsDest()

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.dest = self.inner.reify(envs)
        for env in envs.values():
            env.update(self.extra_env)
        return self.dest

    @property
    def root_log_dir(self) -> str:
        return self.inner.root_log_dir

    def __repr__(self) -> str:
        return f"AgentLogsSpecs({self.inner!r})"


@dataclasses.dataclass(frozen=True)
class IncarnationFiles:
    """Where incarnation ``k`` of a slot writes: ``""`` = the console, as torch has it."""

    stdout: str
    stderr: str
    error_file: str


def _moved(path: str, incarnation: int) -> str:
    if not path or path == os.devnull:
        return path
    head, name = os.path.split(path)
    folder = os.path.join(head, f"inc_{incarnation}")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def incarnation_files(
    stdout: str, stderr: str, error_file: str, incarnation: int
) -> IncarnationFiles:
    """The first process's files (torch's), moved into ``inc_<incarnation>/`` next to them."""
    return IncarnationFiles(
        _moved(stdout, incarnation), _moved(stderr, incarnation), _moved(error_file, incarnation)
    )


def incarnation_launch(
    first: WorkerLaunch, incarnation: int
) -> tuple[WorkerLaunch, IncarnationFiles]:
    """How a slot's ``incarnation``-th process is started: as its first one (``first``), with
    ``TRAINGUARD_INCARNATION`` set and files of its own (:func:`incarnation_files`)."""
    files = incarnation_files(first.stdout, first.stderr, first.error_file, incarnation)
    env = dict(first.env, TRAINGUARD_INCARNATION=str(incarnation))
    if env.get("TORCHELASTIC_ERROR_FILE"):
        env["TORCHELASTIC_ERROR_FILE"] = files.error_file
    launch = dataclasses.replace(first, env=env, stdout=files.stdout, stderr=files.stderr)
    return launch, files


def tail(name: str, dest: LogsDest, local_rank: int, files: IncarnationFiles) -> list[TailLog]:
    """Copy a respawned process's tee'd streams to the console, as torch does for the first."""
    tails = []
    pairs: list[tuple[Mapping[int, str], str, TextIO]] = [
        (dest.tee_stdouts, files.stdout, sys.stdout),
        (dest.tee_stderrs, files.stderr, sys.stderr),
    ]
    for teed, path, stream in pairs:
        if local_rank in teed and path and path != os.devnull:
            tails.append(TailLog(name, {local_rank: path}, stream).start())
    return tails
