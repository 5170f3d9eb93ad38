"""Asynchronous, verifiable checkpoints.

::

    from trainguard.checkpoint import AsyncCheckpointer, latest, load

    with AsyncCheckpointer() as ckpt:             # one persistent writer process
        ckpt.protect(optimizer)                   # fence overlapped staging before step()
        ckpt.save(state, "ckpt/step100", on_durable=print)
        ckpt.poll()                               # callbacks and errors, never blocks
    state = load(latest("ckpt"))

Modules: :mod:`.format` (the file format: :mod:`.format.layout`, state <-> entries + JSON
skeleton; :mod:`.format.write` and :mod:`.format.read`, safetensors-compatible files with
checksums), :mod:`.staging` (shared-memory buffers), :mod:`.writer` (the writer process),
:mod:`.async_save` (the checkpointer, load, latest).

Building blocks for other checkpoint kinds (local checkpoints with replication reuse them):
:func:`.format.layout.flatten` gives entries and a skeleton; :func:`.format.write.place` gives
each entry its offset in the data section; :class:`.staging.Stager` copies the entries to those
offsets in a shared-memory :class:`.staging.StagingBuffer` (whose ``tensor[:nbytes]`` is then
exactly the file's data section, ready to send in one message); a :class:`.writer.WriterProcess`
given a :class:`.writer.WriteJob` writes it durably with :func:`.format.write.write_file`, which
accepts any buffer holding a data section (a received copy too); :func:`.format.read.read_header`,
:func:`.format.read.verify_entries` and :func:`.format.read.load_file` check and read files.

Local checkpoints with replication (:class:`LocalCheckpointManager`, :class:`CliqueReplication`)
live in :mod:`.local`.

Names are imported on first use, so that importing this package (as the writer process does)
does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard import _lazy, _torchcompat

if TYPE_CHECKING:
    from trainguard.checkpoint.async_save import (
        AsyncCheckpointer,
        SaveHandle,
        SaveInfo,
        latest,
        load,
    )
    from trainguard.checkpoint.local import (
        CliqueReplication,
        LocalCheckpointManager,
        LocalOptions,
    )
    from trainguard.checkpoint.options import AsyncOptions

__all__ = [
    "AsyncCheckpointer",
    "AsyncOptions",
    "CliqueReplication",
    "LocalCheckpointManager",
    "LocalOptions",
    "SaveHandle",
    "SaveInfo",
    "latest",
    "load",
]

_HOMES = {
    "AsyncCheckpointer": "trainguard.checkpoint.async_save",
    "AsyncOptions": "trainguard.checkpoint.options",
    "CliqueReplication": "trainguard.checkpoint.local",
    "LocalCheckpointManager": "trainguard.checkpoint.local",
    "LocalOptions": "trainguard.checkpoint.local",
    "SaveHandle": "trainguard.checkpoint.async_save",
    "SaveInfo": "trainguard.checkpoint.async_save",
    "latest": "trainguard.checkpoint.async_save",
    "load": "trainguard.checkpoint.async_save",
}


def _check_torch(name: str) -> None:
    if name != "AsyncOptions":  # needs no torch
        _torchcompat.check_torch()


__getattr__ = _lazy.exports(__name__, _HOMES, before=_check_torch)
