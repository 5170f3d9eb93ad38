"""A storage layer for ``torch.distributed.checkpoint`` (DCP) on trainguard's checkpoints.

::

    import torch.distributed.checkpoint as dcp
    from trainguard.checkpoint import latest
    from trainguard.checkpoint.dcp import AsyncStager, StorageReader, StorageWriter

    writer = StorageWriter(f"{root}/step{step}")          # every rank; keep it for every save
    stager = AsyncStager(writer)
    future = dcp.async_save(state, checkpoint_id=f"{root}/step{step}",
                            storage_writer=writer, async_stager=stager)
    ...
    dcp.load(state, storage_reader=StorageReader(latest(root)))
    stager.close(); writer.close()

Files are trainguard's (one ``rank%05d.safetensors`` per rank, a checksum per entry), written by
the persistent writer process from shared-memory staging buffers; the coordinator commits the
directory with DCP's metadata and the ``COMMITTED`` marker, so
:func:`trainguard.checkpoint.latest` finds it. DCP's planners give resharding: load into any
world size or sharding.

Modules: :mod:`.storage_writer`, :mod:`.storage_reader`, :mod:`.async_stager`,
:mod:`.format_utils` (to and from one ``torch.save`` file); private helpers
``_items`` (write items as file entries) and ``_metadata`` (DCP's metadata file). Importing this
package imports torch.distributed.checkpoint.
"""

from __future__ import annotations

from trainguard import _torchcompat
from trainguard.checkpoint.dcp.async_stager import AsyncStager
from trainguard.checkpoint.dcp.format_utils import dcp_to_torch_save, torch_save_to_dcp
from trainguard.checkpoint.dcp.storage_reader import StorageReader
from trainguard.checkpoint.dcp.storage_writer import StorageWriter

__all__ = [
    "AsyncStager",
    "StorageReader",
    "StorageWriter",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
]

_torchcompat.check_torch()  # torch is imported by now
