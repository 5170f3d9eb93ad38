"""Moving parts between ranks: a dedicated process group and batched point-to-point messages.

The group is created once per manager (a collective over the default group, so every rank
creates it in the same order) and used only by the manager: replication in its background
thread, transfers in ``load``. It never carries the training job's collectives.

- ``gloo`` (CPU, and the default): host tensors are sent as they are; a part's data section is
  one message, straight out of the shared-memory staging buffer or the memory-mapped file.
- ``nccl`` (GPU): host bytes go through a device buffer of this channel (kept and reused; it
  grows to the largest message), since NCCL moves device memory only.

Each exchange posts all its sends and receives as one batch (``batch_isend_irecv``) and waits
for all of them, so members of a clique exchanging with one another cannot deadlock.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch

from trainguard import events

logger = logging.getLogger(__name__)


class Channel:
    """A private process group over every rank of the default group.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: seconds a message may take before the exchange fails (a dead peer).
    """

    def __init__(self, backend: str, timeout: float) -> None:
        import torch.distributed as dist

        self.backend = backend
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._bounce: torch.Tensor | None = None

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        """Send each ``(peer, tensor)`` of ``sends`` and fill each of ``recvs``; blocks.

        Tensors are contiguous host tensors. Messages between one pair of ranks are matched in
        the order they are listed on both sides.
        """
        if not sends and not recvs:
            return
        if self.backend == "nccl":
            with torch.cuda.device(self.device):  # the background thread has no device set
                self._exchange_device(sends, recvs)
            return
        self._run(list(sends), list(recvs))

    def _run(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, t, peer, self.group) for peer, t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for peer, t in recvs if t.numel()]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _exchange_device(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        total = sum(t.numel() for _, t in sends) + sum(t.numel() for _, t in recvs)
        if self._bounce is None or self._bounce.numel() < total:
            self._bounce = None
            self._bounce = torch.empty(total, dtype=torch.uint8, device=self.device)
        offset = 0
        dev_sends, dev_recvs = [], []
        for peer, t in sends:
            d = self._bounce[offset : offset + t.numel()]
            d.copy_(t, non_blocking=True)
            dev_sends.append((peer, d))
            offset += t.numel()
        for peer, t in recvs:
            dev_recvs.append((peer, self._bounce[offset : offset + t.numel()]))
            offset += t.numel()
        self._run(dev_sends, dev_recvs)
        for (_, host), (_, dev) in zip(recvs, dev_recvs, strict=True):
            host.copy_(dev)
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Destroy the group (local for gloo and nccl) and free the device buffer."""
        import torch.distributed as dist

        self._bounce = None
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None


def move_parts(
    channel: Channel | None,
    iteration: int,
    sizes: Mapping[int, int],
    transfers: Sequence[tuple[int, int, int]],
    paths: Mapping[int, str],
    *,
    rank: int,
) -> tuple[int, mmap.mmap] | None:
    """Carry out this rank's share of a transfer plan (every rank calls it with the same plan).

    ``transfers`` lists ``(owner, source, dest)``: the source sends its copy of owner's part
    (a private map of ``paths[owner]``) to the destination, which receives ``sizes[owner]``
    bytes. Returns ``(source, bytes)`` of the part this rank received, or None.
    """
    sends, recvs, maps = [], [], []
    received = None
    for owner, source, dest in transfers:
        if source == rank:
            with open(paths[owner], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            maps.append(mm)
            sends.append((dest, torch.frombuffer(mm, dtype=torch.uint8)))
        if dest == rank:
            buf = mmap.mmap(-1, sizes[owner])
            received = (source, buf)
            recvs.append((source, torch.frombuffer(buf, dtype=torch.uint8)))
    _exchange(channel, iteration, sends, recvs)
    del sends
    for mm in maps:
        with contextlib.suppress(BufferError):
            mm.close()
    return received


def move_ranges(
    channel: Channel | None,
    iteration: int,
    transfers: Sequence[tuple[int, int, int, int, int]],
    paths: Mapping[int, str],
    *,
    rank: int,
) -> dict[int, tuple[int, bytearray]]:
    """Carry out this rank's share of a plan of byte ranges (every rank calls it with the same
    plan, in the same order: messages between two ranks are matched in plan order).

    ``transfers`` lists ``(part, begin, end, source, dest)``: the source sends bytes
    ``[begin, end)`` of its copy of ``part`` (a private map of ``paths[part]``, mapped once per
    part) to the destination. Returns ``{position in transfers: (source, bytes)}`` of what this
    rank received; the caller checks the checksums.
    """
    maps: dict[int, mmap.mmap] = {}
    views: dict[int, torch.Tensor] = {}
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    received: dict[int, tuple[int, bytearray]] = {}
    try:
        for i, (part, begin, end, source, dest) in enumerate(transfers):
            if source == rank and end > begin:
                if part not in views:
                    views[part] = _map_part(paths[part], maps, part)
                sends.append((dest, _slice(views[part], begin, end)))
            if dest == rank:
                buf = bytearray(end - begin)
                received[i] = (source, buf)
                if end > begin:
                    recvs.append((source, torch.frombuffer(buf, dtype=torch.uint8)))
        _exchange(channel, iteration, sends, recvs)
    finally:
        sends.clear()  # drop the views before the maps close
        views.clear()
        for mm in maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
    return received


def _exchange(
    channel: Channel | None,
    iteration: int,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """``channel.exchange`` (when there is anything to move), and its event."""
    if not sends and not recvs:
        return
    assert channel is not None
    started = time.monotonic()
    channel.exchange(sends, recvs)
    events.emit(
        "local_ckpt_transfer",
        duration=time.monotonic() - started,
        iteration=iteration,
        sent=_totals(sends),
        received=_totals(recvs),
    )


def _totals(messages: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """``[(peer, bytes)]`` summed per peer, in peer order."""
    out: dict[int, int] = {}
    for peer, t in messages:
        out[peer] = out.get(peer, 0) + int(t.numel())
    return sorted(out.items())


def _map_part(path: str, maps: dict[int, mmap.mmap], part: int) -> torch.Tensor:
    """The bytes of ``path`` (a private map, kept in ``maps[part]``); empty when it cannot be
    opened (removed since it was verified): its messages become zeros, refused on receipt."""
    try:
        with open(path, "rb") as f:
            maps[part] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the copy %s to send it: %s", path, exc)
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(maps[part], dtype=torch.uint8)


def _slice(whole: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Bytes ``[begin, end)`` of ``whole``; zeros when the copy is shorter (it shrank since it
    was verified): the message keeps its size, and the receiver's checksum refuses it."""
    view = whole[begin:end]
    if view.numel() != end - begin:
        return torch.zeros(end - begin, dtype=torch.uint8)
    return view
