"""Local checkpoints with replication: lose a node, lose nothing.

::

    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

    mgr = LocalCheckpointManager(f"/dev/shm/ckpt-{os.getuid()}", replication=CliqueReplication(2), keep=2)
    it = mgr.find_latest()             # every rank, together
    state = mgr.load(it) if it is not None else None
    mgr.save(state, iteration)         # every rank, together; returns after the staging copy
    mgr.close()

Modules: :mod:`.replication` (who keeps which copies), :mod:`.manager` (the manager),
:mod:`.options` (its settings);
private helpers ``_inventory`` (what a root holds, and the answers all ranks compute alike),
``_choose`` (which iteration to resume from), ``_pipeline`` (the background thread: write,
replicate, settle, retain), ``_transfer`` (the dedicated process group), ``_loading`` (one
round's loading: the steps every load takes, ``find_latest``, newer iterations kept), which
``_part_load`` (``load(it)``: this rank's whole part) and ``_reshard_load``
(``load(it, into=target)``: any sharding, chunks from own copies or received from holders) use.
The store protocols
(all-gather, the commit round of each save) are :mod:`trainguard.coord`'s.
Reuses the file format, staging buffers and writer process of :mod:`trainguard.checkpoint`.
Names are imported on first use: importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard import _lazy

if TYPE_CHECKING:
    from trainguard.checkpoint.local.manager import LocalCheckpointManager
    from trainguard.checkpoint.local.options import LocalOptions
    from trainguard.checkpoint.local.replication import CliqueReplication

__all__ = ["CliqueReplication", "LocalCheckpointManager", "LocalOptions"]

__getattr__ = _lazy.exports(
    __name__,
    {
        "CliqueReplication": "trainguard.checkpoint.local.replication",
        "LocalCheckpointManager": "trainguard.checkpoint.local.manager",
        "LocalOptions": "trainguard.checkpoint.local.options",
    },
)
