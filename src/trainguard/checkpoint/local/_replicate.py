"""Replication's messages: one save's exchange of parts among the members of a clique.

:func:`exchange_parts` is what :class:`~._pipeline.SavePipeline`'s background thread does with
the other members of its clique for one save, over the manager's dedicated group
(:class:`~._transfer.Channel`): first the sizes (header and data section of each part), then
the header and the data section as one message per peer, sent straight out of the staging
buffer and received straight into a shared-memory buffer per peer (:func:`recv_buffer`) that
the writer process maps. The pipeline then has the writer write every received copy.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.staging import StagingBuffer, regrow
from trainguard.checkpoint.writer import WriterProcess
from trainguard.errors import CheckpointWriteError

#: what :func:`exchange_parts` received from one peer: the buffer holding its data section,
#: where each entry lies in it, and the part's metadata
Received = tuple[StagingBuffer, list[PlacedEntry], dict[str, str]]


def exchange_parts(
    channel: Channel,
    peers: list[int],
    *,
    iteration: int,
    placed: list[PlacedEntry],
    buffer: StagingBuffer,
    nbytes: int,
    meta: dict[str, str],
    recv_buffers: dict[int, StagingBuffer],
    writer: WriterProcess,
) -> dict[int, Received]:
    """Send this rank's part of ``iteration`` (``placed`` in the first ``nbytes`` of
    ``buffer``, with ``meta``) to every peer and receive theirs: sizes, then header + data.
    ``recv_buffers`` (per peer) are reused, or regrown (see :func:`recv_buffer`)."""
    header = json.dumps({"placed": [dataclasses.astuple(p) for p in placed], "meta": meta}).encode()
    sizes_out = torch.tensor([len(header), nbytes], dtype=torch.int64)
    sizes_in = {p: torch.zeros(2, dtype=torch.int64) for p in peers}
    channel.exchange([(p, sizes_out) for p in peers], list(sizes_in.items()))
    raw_in = {p: bytearray(int(sizes_in[p][0])) for p in peers}
    headers_in = {p: torch.frombuffer(raw_in[p], dtype=torch.uint8) for p in peers}
    buffers = {}
    for p in peers:
        buffers[p] = recv_buffer(recv_buffers, writer, p, int(sizes_in[p][1]))
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    data_out = buffer.view(0, nbytes)
    sends, recvs = [], []
    for p in peers:
        sends += [(p, header_t), (p, data_out)]
        recvs += [(p, headers_in[p]), (p, buffers[p].view(0, int(sizes_in[p][1])))]
    channel.exchange(sends, recvs)
    out = {}
    for p in peers:
        doc = json.loads(bytes(raw_in[p]))
        peer_placed = [
            PlacedEntry(name, dtype, tuple(shape), offset, entry_nbytes)
            for name, dtype, shape, offset, entry_nbytes in doc["placed"]
        ]
        if doc["meta"].get("owner") != str(p) or doc["meta"].get("iteration") != str(iteration):
            raise CheckpointWriteError(
                f"rank {p} sent {doc['meta'].get('owner')}'s part of iteration "
                f"{doc['meta'].get('iteration')} while this rank saves {iteration}: the "
                "ranks do not call save() with the same iterations in the same order"
            )
        out[p] = (buffers[p], peer_placed, doc["meta"])
    return out


def recv_buffer(
    buffers: dict[int, StagingBuffer], writer: WriterProcess, peer: int, nbytes: int
) -> StagingBuffer:
    """The buffer that receives ``peer``'s data section of ``nbytes``: the one in ``buffers``
    if it is fit, else a new one in its place (the old one detached from ``writer``, closed)."""
    buffer = buffers.get(peer)
    new = regrow(buffer, nbytes, pin=False)
    if new is None:
        assert buffer is not None
        return buffer
    if buffer is not None:
        writer.detach(buffer.id)
        buffer.close()
    buffers[peer] = new
    return new
