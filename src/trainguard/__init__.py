"""trainguard: keep PyTorch training jobs making progress through faults.

Subpackages (imported on demand, importing this package has no side effects):

- :mod:`trainguard.events`: the structured event log.
- :mod:`trainguard.errors`: the exception tree.
- :mod:`trainguard.checkpoint`: asynchronous, verifiable checkpoints (imports torch).
- :mod:`trainguard.report`: goodput report of a run's event logs (``trainguard report``).
"""

from __future__ import annotations

from trainguard.errors import (
    CheckpointError,
    ConfigError,
    CoordinationError,
    RestartError,
    TrainguardError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "CoordinationError",
    "RestartError",
    "TrainguardError",
    "__version__",
]
