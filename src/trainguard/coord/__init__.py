"""Coordination over a ``torch.distributed.Store``: keyspaces per round, barriers, the store process.

Used by :mod:`trainguard.restart`; usable on its own. Nothing here polls on the critical path:
barriers and notices wake through ``Store.wait`` within one store round trip.
"""

from __future__ import annotations

from trainguard.coord.barrier import arrive, wait_forever, wait_key
from trainguard.coord.keys import Keyspace, decode, encode
from trainguard.coord.store import StoreProcess, connect, parse_addr

__all__ = [
    "Keyspace",
    "StoreProcess",
    "arrive",
    "connect",
    "decode",
    "encode",
    "parse_addr",
    "wait_forever",
    "wait_key",
]
