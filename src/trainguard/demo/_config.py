"""The demo's settings: :class:`DemoConfig`, what every demo process is started with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainguard.demo import faults as _faults

__all__ = ["DemoConfig"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo process needs (picklable)."""

    out: str
    ranks: int = 4
    spares: int = 1
    steps: int = 300
    faults: tuple[_faults.Fault, ...] = ()
    local_every: int = 10
    disk_every: int = 50
    report_every: int = 5
    soft_timeout: float = 3.0
    hard_timeout: float = 10.0
    heartbeat_timeout: float = 5.0
    perturb: bool = False  # test hook: flip one bit of one parameter after the first restore
    step_time: float = 0.0  # a step lasts at least this long (seconds): faults land mid-run
    take_out_stragglers: bool = False  # a persistent straggler leaves, a spare takes over
    live: bool = True  # recover from the survivors' live state first (False: checkpoints only)
    resumed: bool = False  # `--resume`: a preempted run continues (no reference run)

    @property
    def world(self) -> int:
        return self.ranks + self.spares

    def to_json(self) -> str:
        """This configuration as JSON (:meth:`from_json` reads it back)."""
        import json

        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoConfig:
        import json

        fields = json.loads(text)
        found = tuple(_faults.Fault(**f) for f in fields.pop("faults"))
        return cls(faults=found, **fields)

    @property
    def events_dir(self) -> Path:
        """The event log of the run (a resumed run's own: its rounds count from 0 again)."""
        return Path(self.out) / ("events-resumed" if self.resumed else "events")

    def local_root(self, process: int) -> Path:
        return Path(self.out) / "local" / f"node{process}"
