"""A reader racing a writer finds one complete checkpoint, every time.

A second process saves to one path in a loop, each save distinguishable (``step`` is a plain
value, kept in the header; ``w`` is tensor data filled with the same number), while this
process reads that path as fast as it can: ``latest(root)``, ``load(path)`` (with and without
``verify``, with and without ``into=``), ``check_file``/``verify_path`` and DCP's
``StorageReader``. Every read must give one whole save (``step == w``), never a false
corruption, never "no checkpoint". Each test runs for a fixed time and checks that the writer
replaced the checkpoint often enough for the race to matter (the numbers of the code before
the fix are in the tests' comments).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import TCPStore
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import latest, load
from trainguard.checkpoint.dcp import StorageReader
from trainguard.checkpoint.format.read import check_file, load_file, verify_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process notice

_N = 4096  # elements of w: a few pages, so a save is quick and a mixed read is visible

_WRITER = """
import os, sys, torch
kind, path, stop, port, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
state = lambda i: {"step": i, "w": torch.full((n,), float(i))}
if kind == "dcp":
    import torch.distributed.checkpoint as dcp
    from trainguard.checkpoint.dcp import StorageWriter
    writer = StorageWriter(path, fsync=False)
    save = lambda i: dcp.save(state(i), storage_writer=writer)
else:
    from trainguard.checkpoint import AsyncCheckpointer
    kwargs = {}
    if kind == "dir":
        from torch.distributed import TCPStore
        store = TCPStore("127.0.0.1", port, None, is_master=False)
        kwargs = dict(store=store, rank=0, world_size=1, commit_timeout=60)
    ckpt = AsyncCheckpointer(fsync=False, **kwargs)
    def save(i):
        ckpt.save(state(i), path)
        ckpt.wait()
i = 1
save(i)
print("ready", flush=True)
while not os.path.exists(stop):
    i += 1
    save(i)
print(i, flush=True)
"""


class _Writer:
    """The second process: saves ``kind`` (``"file"``, ``"dir"``, ``"dcp"``) to ``path``."""

    def __init__(self, kind: str, path: Path, stop: Path, port: int = 0) -> None:
        self.stop = stop
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, kind, str(path), str(stop), str(port), str(_N)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.kill()
            pytest.fail(f"the writer did not start: {self.err[-3000:]}")

    @property
    def err(self) -> str:
        return self._err

    _err = ""

    def saves(self) -> int:
        """Stop it; the number of saves it made."""
        self.stop.touch()
        out, self._err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, self._err[-3000:]
        return int(out.split()[-1])

    def kill(self) -> None:
        if self.proc.returncode is None:
            if self.proc.poll() is None:
                self.proc.kill()
            _, self._err = self.proc.communicate()


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Callable[..., _Writer]]:
    started: list[_Writer] = []

    def start(kind: str, path: Path, port: int = 0) -> _Writer:
        w = _Writer(kind, path, tmp_path / f"stop-{len(started)}", port)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def _whole(state: Any, where: str) -> int:
    """The step of a loaded state; fails unless ``w`` holds that same step (one save)."""
    step = int(state["step"])
    w = state["w"]
    assert bool(w.eq(float(step)).all()), f"{where}: step {step} with w = {w[0].item()}"
    return step


def _race(seconds: float, read: Callable[[], int]) -> tuple[set[int], list[str]]:
    """Call ``read`` for ``seconds``; the steps it returned and the failures it raised."""
    seen: set[int] = set()
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            seen.add(read())
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failures.append(f"{type(exc).__name__}: {exc}")
    return seen, failures


def _report(failures: list[str], reads: object, saves: int, seen: set[int]) -> str:
    """What a race gave, printed (``-s``) and in a failed assertion: counts first."""
    kinds: dict[str, int] = {}
    for f in failures:
        kinds[f[:160]] = kinds.get(f[:160], 0) + 1
    text = f"{len(failures)} failures in {reads} reads, {saves} saves, {len(seen)} steps seen"
    text += "".join(f"; {n} x {k}" for k, n in kinds.items())
    print(text)
    return text


def test_a_file_replaced_while_read_loads_whole(tmp_path: Path, writer: Any) -> None:
    """Item 2: the header is read from the descriptor that is mapped."""
    path = tmp_path / "ckpt.tg"
    w = writer("file", path)
    reads = {"verified": 0, "unverified": 0, "check": 0, "verify_path": 0}

    def read() -> int:
        n = sum(reads.values()) % 4
        if n == 0:
            reads["verified"] += 1
            return _whole(load(path), "load(verify=True)")
        if n == 1:
            reads["unverified"] += 1
            return _whole(load_file(path, verify=False)[0], "load_file(verify=False)")
        if n == 2:
            reads["check"] += 1
            check_file(path)
            return 0
        reads["verify_path"] += 1
        verify_path(path)
        return 0

    try:
        seen, failures = _race(5.0, read)
    finally:
        saves = w.saves()
    report = _report(failures, reads, saves, seen)
    assert not failures, report
    assert saves >= 20 and len(seen) >= 5, f"the writer was too slow to race: {report}"


@pytest.fixture
def store() -> Iterator[TCPStore]:
    s = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60))
    yield s
    del s


def test_latest_and_load_race_an_overwrite(tmp_path: Path, writer: Any, store: TCPStore) -> None:
    """Item 1: ``latest(root)`` always names the directory being overwritten, ``load`` always
    finds one whole checkpoint in it (a part with its marker, whole or resharded)."""
    root = tmp_path / "root"
    root.mkdir()
    path = root / "D"
    w = writer("dir", path, store.port)
    counts = {"latest": 0, "load": 0, "into": 0}

    def read() -> int:
        n = sum(counts.values()) % 3
        if n == 0:
            counts["latest"] += 1
            found = latest(root)
            assert found == path, f"latest() returned {found}"
            return 0
        if n == 1:
            counts["load"] += 1
            return _whole(load(path, rank=0), "load")
        counts["into"] += 1
        into = {"step": -1, "w": torch.zeros(_N)}
        return _whole(load(path, into=into, rank=0), "load(into=)")

    try:
        seen, failures = _race(6.0, read)
    finally:
        saves = w.saves()
    report = _report(failures, counts, saves, seen)
    assert not failures, report
    assert saves >= 20 and len(seen) >= 5, f"the writer was too slow to race: {report}"


def test_dcp_reader_races_an_overwrite(tmp_path: Path, writer: Any) -> None:
    """Item 1 for DCP: ``StorageReader`` reads the marker, the metadata and every part through
    one descriptor of the directory."""
    path = tmp_path / "D"
    w = writer("dcp", path)
    count = [0]

    def read() -> int:
        count[0] += 1
        target = {"step": -1, "w": torch.zeros(_N)}
        dcp.load(target, storage_reader=StorageReader(path))
        return _whole(target, "dcp.load")

    try:
        seen, failures = _race(6.0, read)
    finally:
        saves = w.saves()
    report = _report(failures, count[0], saves, seen)
    assert not failures, report
    assert saves >= 20 and len(seen) >= 5, f"the writer was too slow to race: {report}"
