"""The soak's configuration and its fault schedule (a pure function of the seed).

Fault kinds (each injected by the process that holds the target rank number, when it is
about to run the fault's step; each fires once, claimed by a marker file in the run
directory, see :func:`trainguard.demo.faults.claim`):

``exception``  the rank raises an ordinary exception;
``hang``       the rank blocks in a GIL-releasing sleep (found after the soft timeout);
``kill``       the rank's process is SIGKILLed (a spare takes over; none left: job restart);
``writer``     a checkpoint writer process of the rank (the disk checkpointer's or the local
               manager's, chosen by the seed) is SIGKILLed, in the middle of a write when one
               is under way;
``watcher``    the node watcher (the one helper process of the host's ranks) is SIGKILLed: every
               rank of the node leaves the job (it must not run unwatched), which is what
               losing the node costs; the job restarts;
``lostdir``    the rank's local checkpoint root is deleted and the rank raises, so the next
               round recovers that rank's part from a peer's replica;
``diskfull``   the disk-checkpoint file system (a small tmpfs) is filled up; the space is
               freed again ``disk_every`` steps after the fault (an operator cleaning up).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

KINDS = ("exception", "hang", "kill", "writer", "watcher", "lostdir", "diskfull")
LEAVING = ("kill", "watcher")  # the target process leaves the job (uses up a spare, or all)
FILLER = "soak-filler.bin"  # the file that fills the disk-checkpoint tmpfs


@dataclasses.dataclass(frozen=True)
class PlannedFault:
    """Fault ``kind`` on rank number ``rank`` before step ``step``; ``detail`` refines it."""

    step: int
    rank: int
    kind: str
    detail: str = ""  # writer: "disk" or "local"

    @property
    def label(self) -> str:
        extra = f"/{self.detail}" if self.detail else ""
        return f"{self.kind}{extra}@{self.step}:{self.rank}"


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """Everything the driver and the rank processes share (written as JSON in the run dir)."""

    out: str
    disk: str  # the disk-checkpoint root (a tmpfs mount point, or a plain directory)
    seed: int = 0
    ranks: int = 4
    spares: int = 1
    steps: int = 120
    gap: int = 12  # one fault per `gap` steps
    local_every: int = 4
    disk_every: int = 12
    soft_timeout: float = 3.0
    hard_timeout: float = 10.0
    heartbeat_timeout: float = 5.0
    faults: tuple[PlannedFault, ...] = ()
    marker: str = ""  # value of SOAK_MARKER in every process the soak starts

    @property
    def world(self) -> int:
        return self.ranks + self.spares

    def local_root(self, process: int) -> Path:
        return Path(self.out) / "local" / f"node{process}"

    def save(self) -> Path:
        path = Path(self.out) / "soak-config.json"
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> SoakConfig:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        data["faults"] = tuple(PlannedFault(**f) for f in data["faults"])
        return cls(**data)


def draw_schedule(
    seed: int,
    count: int,
    *,
    ranks: int,
    gap: int,
    local_every: int,
    disk_every: int,
    kinds: tuple[str, ...] = KINDS,
) -> tuple[PlannedFault, ...]:
    """``count`` faults, one in each window of ``gap`` steps, kinds balanced then shuffled.

    Every kind of ``kinds`` appears ``count // len(kinds)`` or one more times (so a schedule of
    at least ``len(kinds)`` faults holds each kind); the order, ranks and steps come from the
    seed. Each fault lies in the second half of its window, so at least ``gap // 2`` steps of
    training (and the checkpoints within them) separate two faults. Where the window allows,
    a ``writer`` fault comes right after its writer was handed a save, and a ``diskfull``
    fault right before a disk save.
    """
    rng = random.Random(seed)
    mix = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(mix)
    faults = []
    for i, kind in enumerate(mix):
        window = range((i + 1) * gap + gap // 2, (i + 2) * gap)
        step = rng.choice(window)
        detail = rng.choice(("disk", "local")) if kind == "writer" else ""
        if kind == "writer":
            every = disk_every if detail == "disk" else local_every
            step = next((s for s in window if s % every == 0), step)
        elif kind == "diskfull":
            step = next((s for s in window if (s + 1) % disk_every == 0), step)
        faults.append(PlannedFault(step, rng.randrange(ranks), kind, detail))
    return tuple(faults)


def steps_for(count: int, gap: int) -> int:
    """Steps of a run with ``count`` faults: one window before the first, one after the last."""
    return (count + 2) * gap
