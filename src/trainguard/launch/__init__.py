"""``trainguard launch``: a torchrun-compatible launcher that replaces dead workers one at a time.

Run it like torchrun (``trainguard launch --nproc-per-node 4 train.py`` or
``python -m trainguard.launch ...``). Its agent respawns a dead worker alone while the others
keep their processes, hosts the job's coordination store, and restarts the whole job (a new
generation) only when a slot crash-loops, uses up its respawn budget, or a worker asks for it
with :func:`escalate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard import _lazy

if TYPE_CHECKING:
    from trainguard.launch.agent import TrainguardAgent
    from trainguard.launch.cli import main
    from trainguard.launch.options import LaunchOptions
    from trainguard.launch.worker import escalate

__all__ = ["LaunchOptions", "TrainguardAgent", "escalate", "main"]

#: where each public name lives: imported at first use, so that a worker's ``escalate`` or
#: ``python -m trainguard.launch.slurm`` does not import torch.distributed.elastic
__getattr__ = _lazy.exports(
    __name__,
    {
        "LaunchOptions": "trainguard.launch.options",
        "TrainguardAgent": "trainguard.launch.agent",
        "escalate": "trainguard.launch.worker",
        "main": "trainguard.launch.cli",
    },
)
