"""Reusable host staging buffers in shared memory, and the copy of a state into them.

A :class:`StagingBuffer` is an anonymous shared-memory file (``memfd``) mapped into this
process as one ``uint8`` tensor. Its file descriptor is handed to the writer process, which maps
the same pages: the writer reads the staged bytes where the copy put them, with no pipe, no
pickling and no intermediate ``bytes``. The memory is freed when both sides have closed it; no
name is ever created in ``/dev/shm``, so a crash of either process cannot leak it.

:class:`Stager` keeps one buffer and reuses it for every save; it grows (by at least half) only
when a state no longer fits, so a steady-state save allocates nothing. Its pages are reserved
with ``fallocate`` and touched once on allocation, outside the copy that later saves time. A
buffer that cannot be reserved (too little memory, ``RLIMIT_AS``, the memory cgroup) is a
:class:`~trainguard.errors.CheckpointError` when it is created, never a SIGBUS or an OOM kill
later.

The copy itself (:meth:`Stager.stage`) is ``torch._foreach_copy_`` over groups of entries of
about equal size, one group per thread (the calling thread takes one), so small tensors cost one
dispatch per group rather than one per tensor, and large ones use all cores. With CUDA present
the buffer is registered as pinned memory and device tensors are copied on a side stream that
first waits for the current stream; :meth:`Stager.stage` returns after that stream has finished.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from trainguard.checkpoint import _memory
from trainguard.checkpoint.format.layout import Entry
from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.errors import CheckpointError

__all__ = ["Stager", "StagingBuffer", "regrow"]

logger = logging.getLogger(__name__)

_ids = itertools.count(1)
_GRANULE = 2 << 20  # sizes are rounded up to 2 MiB (huge-page friendly)


class StagingBuffer:
    """``nbytes`` of shared memory, mapped here as :attr:`tensor` (``uint8``, 1-D).

    ``fd`` is the memfd to send to another process (``multiprocessing.reduction.send_handle``);
    :meth:`close` drops this process's fd and mapping (the pages go when the peer's go too).
    """

    def __init__(self, nbytes: int, *, pin: bool = False, prefault: bool = True) -> None:
        self.id = next(_ids)
        self.nbytes = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        _memory.check(self.nbytes)
        self.fd = os.memfd_create(f"trainguard-staging-{self.id}", os.MFD_CLOEXEC)
        try:
            self.tensor: torch.Tensor | None = _reserve(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # dropped without close()
        if prefault:  # map every page now: the first save then copies at full speed
            started = time.monotonic()
            self.tensor[::4096].zero_()
            logger.debug(
                "prefaulted %d MiB in %.3f s", self.nbytes >> 20, time.monotonic() - started
            )
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                logger.warning("cudaHostRegister of the staging buffer failed (%s)", rc)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        assert self.tensor is not None, "buffer is closed"
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        if self.tensor is None:
            return
        if self.pinned:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = None
        self._close_fd()
        self.fd = -1

    def __repr__(self) -> str:
        return f"StagingBuffer(id={self.id}, nbytes={self.nbytes})"


def _reserve(fd: int, nbytes: int) -> torch.Tensor:
    """Size the memfd ``fd``, reserve its pages (so that a shortage is an error here, not a
    SIGBUS or an OOM kill during a later copy) and map it."""
    try:
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # else: no way to reserve
                raise
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:  # torch reports a failed mmap as RuntimeError
        raise CheckpointError(
            f"could not reserve a staging buffer of {nbytes >> 20} MiB in shared memory "
            f"({type(exc).__name__}: {exc}): save less state per rank, free memory, or raise "
            "the limit that refused it (ulimit -v / -f, the memory cgroup)"
        ) from exc


def regrow(buffer: StagingBuffer | None, nbytes: int, *, pin: bool) -> StagingBuffer | None:
    """The growth policy of every reusable buffer: None when ``buffer`` holds ``nbytes``, else a
    new buffer of at least ``nbytes`` and at least half as large again as ``buffer`` (so a
    slowly growing state allocates rarely). The caller closes the old one when it is unused."""
    if buffer is not None and buffer.nbytes >= nbytes:
        return None
    return StagingBuffer(
        max(nbytes, int(buffer.nbytes * 1.5) if buffer is not None else 0), pin=pin
    )


class Stager:
    """Copies states into one reusable :class:`StagingBuffer`.

    Args:
        threads: copy threads including the caller (1 = copy in the calling thread only).
        pin: register buffers as pinned memory when CUDA is available.

    Not thread-safe: one stage at a time (the checkpointer serializes saves).
    """

    def __init__(self, *, threads: int = 1, pin: bool = True) -> None:
        self.threads = max(1, threads)
        self.pin = pin
        self.buffer: StagingBuffer | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def ensure(self, nbytes: int) -> tuple[StagingBuffer, StagingBuffer | None]:
        """A buffer of at least ``nbytes``; returns ``(buffer, replaced)``.

        ``replaced`` is the previous buffer when it was too small: the caller closes it once
        nothing (the writer) uses it any more.
        """
        old = self.buffer
        new = regrow(old, nbytes, pin=self.pin)
        if new is None:
            assert old is not None
            return old, None
        self.buffer = new
        logger.debug("staging buffer %d: %d MiB", new.id, new.nbytes >> 20)
        return new, old

    def stage(self, entries: Sequence[Entry], placed: Sequence[PlacedEntry]) -> int:
        """Copy every entry's source to its placed offset in the buffer; returns bytes copied.

        ``entries`` and ``placed`` are matched by name. Returns when the bytes are in host memory.
        """
        buffer = self.buffer
        assert buffer is not None, "call ensure() first"
        by_name = {e.name: e for e in entries}
        pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for p in placed:
            if not p.nbytes:
                continue
            src = by_name[p.name].source
            dst = buffer.view(p.offset, p.nbytes).view(src.dtype).view(src.shape)
            pairs.append((p.nbytes, dst, src))
        if not pairs:
            return 0
        cuda = [x for x in pairs if x[2].is_cuda]
        cpu = [x for x in pairs if not x[2].is_cuda]
        if cuda:
            self._stage_cuda(cuda)
        self._stage_cpu(cpu)
        if cuda:
            self._stream.synchronize()
        return sum(x[0] for x in pairs)

    def _stage_cuda(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _, dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def _stage_cpu(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        groups = _split(pairs, self.threads)
        if len(groups) == 1:
            _copy_group(groups[0])
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads - 1, thread_name_prefix="trainguard-stage"
            )
        futures = [self._pool.submit(_copy_group, g) for g in groups[1:]]
        _copy_group(groups[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stop the copy threads and close the buffer."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        self._stream = None


def _split(
    pairs: list[tuple[int, torch.Tensor, torch.Tensor]], parts: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Split copies into up to ``parts`` groups of about equal bytes; big tensors are cut."""
    total = sum(p[0] for p in pairs)
    if parts <= 1 or total < (8 << 20):
        return [[(d, s) for _, d, s in pairs]]
    share = -(-total // parts)
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    room = share
    for nbytes, dst, src in pairs:
        while nbytes > room and src.dim() >= 1 and src.shape[0] > 1 and room > (1 << 20):
            rows = max(1, src.shape[0] * room // nbytes)
            groups[-1].append((dst[:rows], src[:rows]))
            dst, src = dst[rows:], src[rows:]
            nbytes = src.numel() * src.element_size()
            groups.append([])
            room = share
        groups[-1].append((dst, src))
        room -= nbytes
        if room <= 0 and len(groups) < parts:
            groups.append([])
            room = share
    return [g for g in groups if g]


def _copy_group(group: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if len(group) == 1:
        group[0][0].copy_(group[0][1])
        return
    torch._foreach_copy_([d for d, _ in group], [s for _, s in group])
