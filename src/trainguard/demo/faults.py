"""The demo's fault schedule: parsing ``--faults`` and injecting each fault once.

A schedule is a comma-separated list of ``KIND@STEP:RANK``: fault ``KIND`` is injected on the
rank that holds number ``RANK`` when it is about to run step ``STEP``. Kinds:

``exception``
    the rank raises an ordinary ``Exception`` (detected by the raise);
``hang``
    the rank sleeps in a blocking C call that releases the GIL (detected after the
    wrapper's ``soft_timeout``; the restart interrupt wakes it);
``kill``
    the rank's process sends itself SIGKILL (its sidecar reports the death at once; a spare
    takes the rank's number);
``lostdir``
    the rank's node-local checkpoint directory is deleted and the rank raises, so the next
    round must recover that rank's part from a replica on a peer;
``slow``
    the rank's process sleeps :data:`SLOW_S` in its data section of every step from then on
    (a straggler: no error, the heartbeats are fine). Straggler detection names it; with
    ``--take-out-stragglers`` it leaves the job and a spare takes its number;
``preempt``
    the demo sends SIGTERM to every process of the job (:func:`sigterm_job`), as a scheduler
    that preempts it: every rank stops at one agreed step, saves it and exits with status 75;
    ``trainguard demo --resume DIR`` continues the run (``RANK`` is only where it is asked).

A running demo can be asked for more (:func:`request`, :func:`hold`, :func:`release`: files
under ``<run>/faults/requested`` that each rank lists before each step).

Each fault fires once: the injecting process first creates a marker file named after the
fault in the run directory (so a process that replaces the rank, or the same process after a
restart, does not fire it again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import time
from pathlib import Path

from trainguard import _procfs
from trainguard.errors import ConfigError

KINDS = ("exception", "hang", "kill", "lostdir", "slow")
#: kinds that end the run (not in the default schedule): ``preempt``
ENDING = ("preempt",)
SLOW_S = 0.02  #: what a ``slow`` fault adds to each step of its process (seconds)
DEFAULT_SCHEDULE = "exception@45:1,hang@95:2,kill@150:3,lostdir@215:0,slow@240:1"

_ITEM = re.compile(r"^\s*([a-z]+)\s*@\s*(\d+)\s*:\s*(\d+)\s*$")


class InjectedFault(Exception):
    """Raised by the demo's ``exception`` and ``lostdir`` faults."""


@dataclasses.dataclass(frozen=True, order=True)
class Fault:
    """One scheduled fault: ``kind`` on rank number ``rank`` before step ``step``."""

    step: int
    rank: int
    kind: str

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


def parse(text: str, *, ranks: int, spares: int, steps: int) -> tuple[Fault, ...]:
    """Parse and check a schedule against the run's shape; ConfigError names the fix."""
    faults: list[Fault] = []
    for item in (s for s in text.split(",") if s.strip()):
        m = _ITEM.match(item)
        if not m:
            raise ConfigError(
                f"--faults item {item.strip()!r} is not KIND@STEP:RANK; "
                f"write e.g. 'exception@40:1' (kinds: {', '.join(KINDS)})"
            )
        kind, step, rank = m.group(1), int(m.group(2)), int(m.group(3))
        if kind not in KINDS + ENDING:
            raise ConfigError(
                f"--faults: unknown kind {kind!r}; use one of {', '.join(KINDS + ENDING)}"
            )
        if not 0 < step < steps:
            raise ConfigError(
                f"--faults {item.strip()!r}: step {step} must be between 1 and {steps - 1} "
                f"(--steps {steps})"
            )
        if rank >= ranks:
            raise ConfigError(
                f"--faults {item.strip()!r}: rank {rank} does not exist with --ranks {ranks}"
            )
        faults.append(Fault(step, rank, kind))
    faults.sort()
    steps_seen = [f.step for f in faults]
    if len(set(steps_seen)) != len(steps_seen):
        raise ConfigError("--faults: two faults at the same step; give each its own step")
    kills = sum(f.kind == "kill" for f in faults)
    if kills > spares:
        raise ConfigError(
            f"--faults kills {kills} rank(s) but --spares is {spares}: the world would shrink "
            f"and the data shards with it; use --spares {kills} or fewer kills"
        )
    return tuple(faults)


def marker(run_dir: str | os.PathLike[str], fault: Fault) -> Path:
    return Path(run_dir) / "faults" / f"{fault.step:06d}-{fault.kind}-r{fault.rank}.fired"


def claim(run_dir: str | os.PathLike[str], fault: Fault) -> bool:
    """True exactly once per fault and run directory (the marker is created atomically)."""
    path = marker(run_dir, fault)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()} {time.time():.6f}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def request(run_dir: str | os.PathLike[str], fault: Fault) -> None:
    """Add ``fault`` to the schedule of a running demo (its processes look before each step)."""
    folder = Path(run_dir) / "faults" / "requested"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / fault.label).touch()


def hold(run_dir: str | os.PathLike[str], step: int) -> None:
    """Make every rank of a running demo wait before step ``step`` until :func:`release` of
    that step (several steps may be held, each released on its own)."""
    folder = Path(run_dir) / "faults" / "requested"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"hold@{step}").touch()


def release(run_dir: str | os.PathLike[str], step: int) -> None:
    """End the wait that :func:`hold` asked for at ``step`` (before or after it began)."""
    folder = Path(run_dir) / "faults" / "requested"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"release@{step}").touch()


@dataclasses.dataclass(frozen=True)
class Requests:
    """What a running demo was asked so far: faults, and the held steps not released yet."""

    faults: tuple[Fault, ...] = ()
    held: frozenset[int] = frozenset()


def requested(run_dir: str | os.PathLike[str]) -> Requests:
    """The requests of :func:`request`, :func:`hold` and :func:`release` (one listing)."""
    try:
        names = os.listdir(Path(run_dir) / "faults" / "requested")
    except FileNotFoundError:
        return Requests()
    found: list[Fault] = []
    held: set[int] = set()
    released: set[int] = set()
    for name in names:
        m = _ITEM.match(name)
        kind, _, at = name.partition("@")
        if m:
            found.append(Fault(int(m.group(2)), int(m.group(3)), m.group(1)))
        elif kind in ("hold", "release") and at.isdigit():
            (held if kind == "hold" else released).add(int(at))
    return Requests(tuple(found), frozenset(held - released))


def inject(fault: Fault) -> None:
    """Carry out ``fault`` in this process (``lostdir``'s deletion and ``slow``'s sleeps are
    the caller's part)."""
    if fault.kind in ("slow", "preempt"):  # the demo itself signals a preemption
        return
    if fault.kind == "exception":
        raise InjectedFault(f"injected exception on rank {fault.rank} at step {fault.step}")
    if fault.kind == "hang":
        time.sleep(24 * 3600)  # releases the GIL; the restart interrupt ends it
        raise AssertionError("the hang ended without a restart interrupt")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered before this returns
    if fault.kind == "lostdir":
        raise InjectedFault(
            f"injected: rank {fault.rank} lost its local checkpoint directory at step {fault.step}"
        )
    raise ConfigError(f"unknown fault kind {fault.kind!r}")


def sigterm_job(root: int) -> list[int]:
    """SIGTERM to every process that descends from ``root`` (the demo's own process), as a
    scheduler signals every process of a job it preempts: ranks, spares, store server,
    sidecars, checkpoint writers. Returns the pids signalled."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = _procfs.parent_of(int(entry))
        except ValueError:
            continue
        if parent is None:
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    return found
