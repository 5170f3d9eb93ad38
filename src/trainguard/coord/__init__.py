"""Coordination over a ``torch.distributed.Store``: keyspaces per round, waits, the store process,
the two counting protocols the checkpointers share (a commit round decided once, a gather), the
launcher's whole-job restart request (:func:`escalate`), a store's listening socket bound to one
interface (:func:`bind_host`, :func:`listen`) and a store start failure told to the ranks that
wait for it (:class:`StartNotice`).

The low-level layer under :mod:`trainguard.restart`, :mod:`trainguard.checkpoint` and
:mod:`trainguard.launch`: its names are public for those who build on a store directly, but they
may change between releases (the user-facing names are in those packages). Nothing here polls on
the critical path: waits wake through ``Store.wait`` within one store round trip.
"""

from __future__ import annotations

from trainguard.coord._bind import bind_host, is_loopback, listen, port_of
from trainguard.coord._startfail import StartNotice
from trainguard.coord.barrier import timed_out, wait_all, wait_forever, wait_key
from trainguard.coord.commit import CommitRound, Outcome
from trainguard.coord.escalation import escalate, escalation_reason
from trainguard.coord.gather import gather
from trainguard.coord.keys import Keyspace, decode, encode
from trainguard.coord.store import StoreProcess, connect, parse_addr

__all__ = [
    "CommitRound",
    "Keyspace",
    "Outcome",
    "StartNotice",
    "StoreProcess",
    "bind_host",
    "connect",
    "decode",
    "encode",
    "escalate",
    "escalation_reason",
    "gather",
    "is_loopback",
    "listen",
    "parse_addr",
    "port_of",
    "timed_out",
    "wait_all",
    "wait_forever",
    "wait_key",
]
