"""AsyncStager: ``dcp.async_save`` stalls training only for the copy into shared memory.

DCP's ``async_save`` first asks a stager for a copy of the state that later training cannot
change, then saves that copy in a background thread. This stager copies every tensor (the local
shard of a DTensor) into one reusable shared-memory buffer, laid out as the data section of this
rank's file; the :class:`~trainguard.checkpoint.dcp.StorageWriter` it was built on then hands
that very buffer to its writer process: no second copy, no new memory per save.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import staging
from torch.distributed.tensor import DTensor

from trainguard import _timeouts, _torchcompat, events
from trainguard.checkpoint.dcp import _items
from trainguard.checkpoint.dcp.storage_writer import StorageWriter
from trainguard.checkpoint.format.layout import Entry
from trainguard.checkpoint.format.write import place
from trainguard.checkpoint.staging import Stager
from trainguard.errors import CheckpointError, ConfigError

__all__ = ["AsyncStager"]

logger = logging.getLogger(__name__)

_SLACK = 1 << 20  # room after the staged tensors for DCP's pickled (bytes) items


class AsyncStager(staging.AsyncStager):
    """Stages states for ``dcp.async_save(state, storage_writer=writer, async_stager=stager)``.

    Protocol: build it on the :class:`StorageWriter` it stages for, and pass both to every
    ``dcp.async_save`` call (every rank its own pair). ``stage()`` (called by ``async_save`` in
    the training thread) returns once the copy is in shared memory: that copy is the whole stall
    of ``async_save``; the state may change right after. It first waits until the writer has
    written the previous staged state (the buffer is reused): call ``result()`` on the previous
    ``async_save``'s future before the next save (as torchtitan does), or ``stage()`` waits,
    at most ``busy_timeout``, and then raises :class:`CheckpointError`. A save that fails
    before it writes (refused path, planning error on any rank) frees the buffer too.

    ``should_synchronize_after_execute`` is False and :meth:`synchronize_staging` does nothing:
    staging is finished when ``stage()`` returns, so there is nothing to wait for. :meth:`close`
    (or the end of a ``with`` block) frees the buffer; DCP never closes a stager the caller
    passed. Close the stager before its writer.

    Args:
        storage_writer: the writer whose saves write the staged states.
        staging_threads: threads that copy (default: up to 4).
        pin_memory: register the buffer as pinned memory when CUDA is available.
        busy_timeout: how long ``stage()`` waits for the previous staged state to be written.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        storage_writer: StorageWriter,
        *,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        busy_timeout: _timeouts.Timeout = 600.0,
    ) -> None:
        if not isinstance(storage_writer, StorageWriter):
            raise ConfigError(
                f"storage_writer={storage_writer!r}: give the "
                "trainguard.checkpoint.dcp.StorageWriter that will write the staged states"
            )
        if staging_threads is not None and (
            isinstance(staging_threads, bool)
            or not isinstance(staging_threads, int)
            or staging_threads < 1
        ):
            raise ConfigError("staging_threads must be an int >= 1 (or None for the default)")
        self.busy_timeout = _timeouts.seconds("busy_timeout", busy_timeout)
        self.writer = storage_writer
        self._stager = Stager(
            threads=staging_threads or min(4, os.cpu_count() or 1), pin=pin_memory
        )
        self._closed = False
        self.last_stage_seconds = 0.0  # the stall of the latest stage()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in the shared-memory buffer (DTensors stay
        DTensors with the same mesh and placements); non-tensor values are deep-copied."""
        if self._closed:
            raise CheckpointError("this AsyncStager is closed; create a new one")
        _refuse_process_executor(_torchcompat.dcp_async_executor())
        started = time.monotonic()
        if not self.writer._wait_free(self.busy_timeout):
            raise CheckpointError(
                f"the previous staged state was not written within busy_timeout="
                f"{self.busy_timeout:g} s: wait for the previous dcp.async_save's future "
                "(.result()) before the next save, or raise busy_timeout"
            )
        self.writer._check_open()
        leaves: list[torch.Tensor] = []
        build = _collect(state_dict, leaves)
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in leaves]
        entries = [_items.tensor_entry(f"s{i}", t) for i, t in enumerate(locals_)]
        placed, total = place(entries)
        buffer, old = self._stager.ensure(total + _SLACK)
        self._stager.stage(entries, placed)
        views = [
            _view(buffer.tensor, p.offset, e)
            for e, p in zip(entries, _by_name(entries, placed), strict=True)
        ]
        staged = [
            DTensor(v, t._spec, requires_grad=False) if isinstance(t, DTensor) else v
            for t, v in zip(leaves, views, strict=True)
        ]
        by_ptr = {
            v.data_ptr(): p
            for v, p in zip(views, _by_name(entries, placed), strict=True)
            if p.nbytes
        }
        self.writer._stage_into(_items.Staged(buffer, placed, by_ptr, total), old)
        self.last_stage_seconds = time.monotonic() - started
        events.emit("ckpt_staged", duration=self.last_stage_seconds, bytes=total)
        result: dict[str, Any] = build(iter(staged))
        return result

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns after the copy."""

    def close(self) -> None:
        """Free the staging buffer (the writer unmaps it with its next save or close)."""
        if self._closed:
            return
        self._closed = True
        if self._stager.buffer is not None:
            self.writer._retired.append(self._stager.buffer)
        self._stager.close()

    def __enter__(self) -> AsyncStager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_process_executor(executor: str | None) -> None:
    """:class:`ConfigError` when ``dcp.async_save`` called :meth:`AsyncStager.stage` for
    ``AsyncCheckpointerType.PROCESS`` (``executor``, as :func:`_torchcompat.dcp_async_executor`
    finds it): the staged shared memory cannot go to DCP's background process (it would fail
    there with a bad file descriptor)."""
    if executor == "process":
        raise ConfigError(
            "trainguard's AsyncStager stages into this process's shared memory, which "
            "DCP's background process cannot map: pass async_checkpointer_type="
            "AsyncCheckpointerType.THREAD (the default) with it, or leave out "
            "async_stager to use AsyncCheckpointerType.PROCESS"
        )


def _by_name(entries: list[Entry], placed: list[Any]) -> list[Any]:
    """``placed`` in the order of ``entries``."""
    where = {p.name: p for p in placed}
    return [where[e.name] for e in entries]


def _view(buffer: torch.Tensor | None, offset: int, entry: Entry) -> torch.Tensor:
    src = entry.source
    if buffer is None or not entry.nbytes:
        return torch.empty(src.shape, dtype=src.dtype)
    return buffer[offset : offset + entry.nbytes].view(src.dtype).view(src.shape)


def _collect(node: Any, leaves: list[torch.Tensor]) -> Callable[[Any], Any]:
    """Append ``node``'s tensors to ``leaves``; return a function that rebuilds ``node`` from
    an iterator over their staged copies (in the same order)."""
    if isinstance(node, torch.Tensor):
        leaves.append(node)
        return next
    if isinstance(node, dict):
        parts = [(k, _collect(v, leaves)) for k, v in node.items()]
        return lambda it: {k: f(it) for k, f in parts}
    if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
        items = [_collect(v, leaves) for v in node]
        kind = type(node)
        return lambda it: kind(f(it) for f in items)
    value = copy.deepcopy(node)
    return lambda it: value
