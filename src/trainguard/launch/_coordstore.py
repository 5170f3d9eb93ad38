"""The coordination store of a launched job, and the keys the agents keep in it.

The store lives in the agent of group rank 0 for that agent's whole life (a worker's death never
takes it down), listening on the rendezvous interface only; or it is an external store
(``--tg-store`` / ``TRAINGUARD_STORE_ADDR``). Protocol, once per rendezvous round (after
torch's rendezvous, before the workers start):

1. The group-rank-0 agent opens the store (the first time) and bumps the job's generation
   counter with ``add`` (the generation never repeats for a run id in one store, even when
   another agent hosts the store after a membership change: it starts from the last generation
   it saw plus one).
2. It publishes ``{"addr": "host:port", "generation": g}`` under ``published_key()`` in the
   round's rendezvous store (a fresh key prefix each round, so no agent reads an old one).
3. Every other agent reads that key (blocking, with the rendezvous store's timeout) and
   connects to the address.

Keys (all under ``trainguard/launch/<run_id>/``, named in :mod:`trainguard.launch._keys`):
``generation`` (the counter: generations started), ``escalate/g<gen>`` (set by any agent or
worker to restart the whole job; the value is the reason; :mod:`trainguard.coord.escalation`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from trainguard import _torchcompat
from trainguard.coord import bind_host, is_loopback, listen
from trainguard.coord.escalation import escalate, escalation_reason
from trainguard.coord.store import StoreLike, as_store, connect, parse_addr
from trainguard.errors import CoordinationError
from trainguard.launch._keys import generation_key, published_key

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

__all__ = [
    "CoordStore",
    "Generation",
    "format_addr",
]

logger = logging.getLogger(__name__)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One rendezvous round's result: where the store is and the job's generation."""

    addr: str
    generation: int


class CoordStore:
    """One agent's handle on the job's coordination store (see the module docstring).

    Args:
        external: ``(host, port)`` of an external store, or ``None`` (agent 0 hosts one).
        timeout: store operation timeout in seconds.
    """

    def __init__(self, *, external: tuple[str, int] | None, timeout: float) -> None:
        self.external = external
        self.timeout = timeout
        self.server: Any = None  # the TCPStore this agent hosts, if any
        self.client: Any = None  # this agent's connection (the server object when hosting)
        self.addr: str | None = None
        self.last_generation = -1

    def join_group(self, group: WorkerGroup, run_id: str) -> Generation:
        """:meth:`join` after torch's rendezvous gave this agent ``group``: its store, its group
        rank, and the address of this machine that the others reach (agent 0's store binds to
        that interface only, or to loopback for a job on one machine)."""
        advertise = group.master_addr or socket.getfqdn()
        local = bool(group.spec.local_addr) or is_loopback(advertise)
        assert group.store is not None, "torch's rendezvous gave the worker group no store"
        return self.join(
            as_store(group.store),
            group_rank=group.group_rank or 0,
            run_id=run_id,
            advertise=advertise,
            bind=bind_host(advertise, local=local),
        )

    def join(
        self, rdzv_store: StoreLike, *, group_rank: int, run_id: str, advertise: str, bind: str
    ) -> Generation:
        """Step 1-3 of the protocol for this agent; returns the round's :class:`Generation`.

        ``advertise``: the address other machines reach this one by (used by agent 0);
        ``bind``: the address its store listens on (``""``: every interface).
        """
        if group_rank == 0:
            addr = self._open(advertise, bind)
            generation = self._bump(run_id)
            rdzv_store.set(published_key(), json.dumps({"addr": addr, "generation": generation}))
        else:
            try:
                published = json.loads(rdzv_store.get(published_key()))
                addr, generation = str(published["addr"]), int(published["generation"])
            except Exception as exc:
                raise CoordinationError(
                    f"agent 0 did not publish the coordination store ({exc}); check that every "
                    "node runs trainguard launch (not torchrun) with the same options"
                ) from exc
            if addr != self.addr or self.client is None:
                return self.adopt(addr, generation)
        self.addr, self.last_generation = addr, generation
        return Generation(addr, generation)

    def adopt(self, addr: str, generation: int) -> Generation:
        """Connect to the store at ``addr`` in ``generation``: what agents other than 0 do in
        :meth:`join`, and what a replacement node does with the vacancy it claimed (no
        rendezvous round)."""
        host, port = parse_addr(addr)
        self.client = connect(host, port, timeout=self.timeout)
        self.addr, self.last_generation = addr, generation
        return Generation(addr, generation)

    def reconnect(self) -> None:
        """A new connection to the store in place of one whose call failed (a late reply on
        the old one would be read as the answer to the next request). The agent that hosts
        the store keeps using the server. Raises while the store is out of reach."""
        if self.server is not None or self.addr is None:
            return
        if self.external is not None:
            host, port = self.external
        else:
            host, port = parse_addr(self.addr)
        self.client = connect(host, port, timeout=self.timeout)

    def _open(self, advertise: str, bind: str) -> str:
        if self.external is not None:
            host, port = self.external
            if self.client is None:
                self.client = connect(host, port, timeout=self.timeout)
            return format_addr(host, port)
        if self.server is None:
            self.server = _torchcompat.host_store(
                advertise,
                listen(bind, 0),
                timeout=timedelta(seconds=self.timeout),
                multi_tenant=True,
            )
            logger.info("coordination store listening on %s:%d", bind or "*", self.server.port)
        self.client = self.server
        return format_addr(advertise, int(self.server.port))

    def _bump(self, run_id: str) -> int:
        key = generation_key(run_id)
        started = int(self.client.add(key, 0))
        floor = self.last_generation + 1  # a generation this agent has not seen yet
        return int(self.client.add(key, max(1, floor + 1 - started))) - 1

    def escalate(self, run_id: str, generation: int, reason: str) -> None:
        """Ask every agent to restart the whole job (first reason wins)."""
        escalate(self.client, run_id, generation, reason)

    def escalation(self, run_id: str, generation: int) -> str | None:
        """The reason of a whole-job restart asked for in ``generation``, or ``None``. One
        ``check`` when there is none."""
        return escalation_reason(self.client, run_id, generation)

    def close(self) -> None:
        """Drop the connection and stop the hosted store (its clients see it go)."""
        self.client = None
        self.server = None
