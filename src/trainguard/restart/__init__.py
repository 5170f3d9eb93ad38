"""In-process restart: when any rank faults, every rank unwinds and calls the function again.

    import trainguard.restart as tr

    @tr.Wrapper(rank_filter=tr.MaxActiveWorldSize(8), max_rounds=100)
    def train(call: tr.CallWrapper, cfg):
        torch.distributed.init_process_group("gloo")   # the round's RANK/WORLD_SIZE/MASTER_*
        ...

    result = train(cfg)        # on every rank

See :mod:`trainguard.restart.wrapper` for the protocol. Importing this package imports no
torch; the first call does.
"""

from __future__ import annotations

from trainguard.restart.config import WrapperConfig
from trainguard.restart.policy import (
    ActiveWorldSizeDivisibleBy,
    Compose,
    FillGaps,
    GroupedByKey,
    Layout,
    MaxActiveWorldSize,
    RetryController,
    ShiftRanks,
)
from trainguard.restart.preempt import Preempted
from trainguard.restart.probes import FreeSpaceProbe, FsyncProbe, MatmulProbe
from trainguard.restart.quarantine import Quarantine
from trainguard.restart.state import RestartInterrupt, RoundState
from trainguard.restart.wrapper import CallWrapper, Wrapper

__all__ = [
    "ActiveWorldSizeDivisibleBy",
    "CallWrapper",
    "Compose",
    "FillGaps",
    "FreeSpaceProbe",
    "FsyncProbe",
    "GroupedByKey",
    "Layout",
    "MatmulProbe",
    "MaxActiveWorldSize",
    "Preempted",
    "Quarantine",
    "RestartInterrupt",
    "RetryController",
    "RoundState",
    "ShiftRanks",
    "Wrapper",
    "WrapperConfig",
]
