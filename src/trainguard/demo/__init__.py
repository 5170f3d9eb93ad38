"""The demo's workload (``trainguard demo`` is built on it).

:mod:`trainguard.demo.model`: a student MLP learns a fixed random teacher; every batch is a pure
function of (seed, step, rank), so a resumed run is bit-identical to an uninterrupted one.
Importing this package does not import torch.
"""

__all__: list[str] = []
