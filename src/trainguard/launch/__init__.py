"""``trainguard launch``: a torchrun-compatible launcher that replaces dead workers one at a time.

Run it like torchrun (``trainguard launch --nproc-per-node 4 train.py`` or
``python -m trainguard.launch ...``). Its agent respawns a dead worker alone while the others
keep their processes, hosts the job's coordination store, and restarts the whole job (a new
generation) only when a slot crash-loops, uses up its respawn budget, or a worker asks for it
with :func:`escalate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.launch.agent import TrainguardAgent
    from trainguard.launch.cli import main
    from trainguard.launch.options import LaunchOptions
    from trainguard.launch.worker import escalate

__all__ = ["LaunchOptions", "TrainguardAgent", "escalate", "main"]

#: where each public name lives: imported at first use, so that a worker's ``escalate`` or
#: ``python -m trainguard.launch.slurm`` does not import torch.distributed.elastic
_HOMES = {
    "LaunchOptions": "trainguard.launch.options",
    "TrainguardAgent": "trainguard.launch.agent",
    "escalate": "trainguard.launch.worker",
    "main": "trainguard.launch.cli",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'trainguard.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
