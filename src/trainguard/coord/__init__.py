"""Coordination over a ``torch.distributed.Store``: keyspaces per round, waits, the store process,
and the two counting protocols the checkpointers share (a commit round decided once, a gather).

Used by :mod:`trainguard.restart` and :mod:`trainguard.checkpoint`; usable on its own. Nothing
here polls on the critical path: waits wake through ``Store.wait`` within one store round trip.
"""

from __future__ import annotations

from trainguard.coord.barrier import timed_out, wait_all, wait_forever, wait_key
from trainguard.coord.commit import CommitRound, Outcome
from trainguard.coord.gather import gather
from trainguard.coord.keys import Keyspace, decode, encode
from trainguard.coord.store import StoreProcess, connect, parse_addr

__all__ = [
    "CommitRound",
    "Keyspace",
    "Outcome",
    "StoreProcess",
    "connect",
    "decode",
    "encode",
    "gather",
    "parse_addr",
    "timed_out",
    "wait_all",
    "wait_forever",
    "wait_key",
]
