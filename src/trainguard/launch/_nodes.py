"""What an agent knows and does about the nodes of its job: its place, lost nodes, the exit.

**Place.** After each rendezvous round (or after taking a lost node's place) an agent knows its
:class:`Place`: group rank, group world size, its workers' global ranks, where the
coordination store is, the workers' ``MASTER_ADDR``/``MASTER_PORT``. It is what a vacancy
offers (:meth:`Place.vacancy`) and what a replacement node rebuilds (:func:`adopted_workers`).

**What the agent does** (:class:`AgentNodes`, one per agent): after each rendezvous it follows
the generation in the admission gate, publishes its workers' ranks and (group rank 0) drops the
vacancies of older generations (:meth:`AgentNodes.enter`); before its first rendezvous it claims
a vacancy and, when it gets one, takes that node's place (:meth:`AgentNodes.take_vacancy`); its
heartbeat (:meth:`AgentNodes.heartbeat`, its member of the generation's node ring:
:func:`trainguard.launch.heartbeat.node_ring`) calls :meth:`AgentNodes.lost`,
:meth:`AgentNodes.back` and :meth:`AgentNodes.evicted`.

**Exit barrier.** torch's agents wait for each other in the rendezvous store until *every* node
arrived, so a node that was lost costs the survivors the whole exit-barrier timeout (and when
the lost node hosted the rendezvous store the barrier fails). Here each node writes
``g<gen>/exit/<node>`` in the coordination store: ``done`` when its workers finished, and the
agent that declared a node lost writes ``lost`` for it (:func:`mark_lost`). The barrier
(:func:`exit_barrier`) waits until every node's key exists: finished and lost nodes count, a
replacement node deletes its node's ``lost`` (:func:`reopen`) before its workers start. One
``check`` per poll per agent, and only while the agent waits to exit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup

from trainguard import _torchcompat, events
from trainguard.coord.node_ring import NodeRing
from trainguard.coord.store import StoreLike
from trainguard.errors import ConfigError
from trainguard.launch import _compat
from trainguard.launch._coordstore import CoordStore, Generation
from trainguard.launch._gate import (
    AdmissionGate,
    Vacancy,
    claim_vacancy,
    drop_vacancies,
    mark_vacant,
)
from trainguard.launch._keys import escalate_key, exit_key, replaced_key
from trainguard.launch.heartbeat import node_ranks, node_ring, publish_ranks
from trainguard.launch.options import LaunchOptions

__all__ = [
    "AgentNodes",
    "Place",
    "adopted_workers",
    "exit_barrier",
    "mark_done",
    "mark_lost",
    "reopen",
    "replacement_incarnation",
]

logger = logging.getLogger(__name__)

DONE = "done"
LOST = "lost"


@dataclasses.dataclass(frozen=True)
class Place:
    """One agent's place in one generation of the job (see the module docstring)."""

    run_id: str
    generation: int
    node: int
    nodes: int
    world_size: int
    ranks: tuple[int, ...]
    store_addr: str
    master_addr: str
    master_port: int

    def vacancy(self, node: int) -> Vacancy:
        """The vacancy that lost ``node`` of this generation leaves."""
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(Vacancy)}
        return Vacancy(**dict(same, node=node))


def adopted_workers(
    vacancy: Vacancy, ranks: list[int] | None, local_world_size: int
) -> list[Worker]:
    """The workers a replacement node starts in place of lost node ``vacancy.node``, whose
    workers had the global ``ranks`` (as it published them); one role, as torchrun has it."""
    if ranks is None or len(ranks) != local_world_size:
        had = "published no ranks" if ranks is None else f"had {len(ranks)} workers"
        raise ConfigError(
            f"the lost node {vacancy.node} {had}; this node starts {local_world_size}: start "
            "the replacement with the lost node's --nproc-per-node"
        )
    n = vacancy.world_size  # one role: role ranks are global ranks
    return [
        Worker(i, global_rank=r, role_rank=r, world_size=n, role_world_size=n)
        for i, r in enumerate(ranks)
    ]


def replacement_incarnation(store: StoreLike, run_id: str, generation: int, node: int) -> int:
    """The incarnation of a replacement node's workers: k for the k-th node that took
    ``node``'s place in ``generation`` (always >= 1: the workers join as newcomers)."""
    return int(store.add(replaced_key(run_id, generation, node), 1))


def mark_done(store: StoreLike, run_id: str, generation: int, node: int) -> None:
    """``node``'s workers finished (its agent enters the exit barrier)."""
    store.set(exit_key(run_id, generation, node), DONE)


def mark_lost(store: StoreLike, run_id: str, generation: int, node: int) -> None:
    """The agent that declared ``node`` lost: the others' exit barrier does not wait for it."""
    store.set(exit_key(run_id, generation, node), LOST)


def reopen(store: StoreLike, run_id: str, generation: int, node: int) -> None:
    """A replacement node took ``node``'s place: the exit barrier waits for it again."""
    store.delete_key(exit_key(run_id, generation, node))


def exit_barrier(
    store: StoreLike, place: Place, *, timeout: float, poll: float, clock: Any = time.monotonic
) -> list[int]:
    """Every agent whose workers finished: write ``done`` and wait until every node of
    ``place.generation`` finished or was lost, at most ``timeout`` seconds; stop waiting too
    when a whole-job restart was asked for. Returns the nodes still missing (``[]``: none)."""
    mark_done(store, place.run_id, place.generation, place.node)
    keys = [exit_key(place.run_id, place.generation, n) for n in range(place.nodes)]
    escalate = [escalate_key(place.run_id, place.generation)]
    end = clock() + timeout
    while True:
        if store.check(keys):
            return []
        if store.check(escalate):
            logger.warning(
                "generation %d is restarting as a whole; this node's workers had finished",
                place.generation,
            )
            return []
        if clock() >= end:
            return [n for n, key in enumerate(keys) if not store.check([key])]
        time.sleep(poll)


class AgentNodes:
    """One agent's dealings with the other nodes of its job (see the module docstring).

    Args:
        run_id: the rendezvous run id.
        options: the agent's options (heartbeat interval and timeout, exit-barrier timeout).
        coord: the agent's coordination store handle.
        gate: the admission gate (c10d rendezvous), or ``None``: no vacancies.
        log: the agent's event log.
        gone: called with each rank of a node this agent declared lost, and why (the sidecar
            service counts it out).

    Protocol (the agent's thread): :meth:`take_vacancy` before the first rendezvous,
    :meth:`enter` after each, :meth:`heartbeat` to make the generation's heartbeat,
    :attr:`evicted` checked on each monitor tick, :meth:`exit_barrier` when the workers
    finished. :meth:`lost`, :meth:`back`, :meth:`evicted` run on the heartbeat's thread.
    """

    def __init__(
        self,
        *,
        run_id: str,
        options: LaunchOptions,
        coord: CoordStore,
        gate: AdmissionGate | None,
        log: events.EventLog,
        gone: Callable[[int, str], None],
    ) -> None:
        self.run_id, self.options, self.coord, self.gate = run_id, options, coord, gate
        self.log, self.gone = log, gone
        self.place: Place | None = None  # this node in the current generation
        #: why this node must stop (another node declared it lost), or None.
        self.eviction: str | None = None
        #: set when the heartbeat reached the store again after failed beats (the agent
        #: lifts its fence and clears it).
        self.reached_again = False

    def take_vacancy(
        self, group: WorkerGroup, *, fresh: bool = False
    ) -> tuple[Generation, int] | None:
        """Claim a lost node's place and set ``group`` up as that node (group rank, ranks,
        master address, the store and generation of the vacancy); returns the generation and
        the workers' incarnation. ``None`` (rendezvous as usual) when there is no vacancy or
        the generation it belongs to is over. ``fresh``: claim over a new connection to the
        rendezvous store (an evicted node's old one may hold a late reply)."""
        if self.gate is None:
            return None
        store = self.gate.store
        if fresh:
            store = _torchcompat.clone_store(store) or store
        vacancy = claim_vacancy(store, self.run_id)
        if vacancy is None:
            return None
        try:
            joined = self.coord.adopt(vacancy.store_addr, vacancy.generation)
            if self.coord.escalation(self.run_id, vacancy.generation) is not None:
                logger.info("generation %d is restarting: rendezvous instead", vacancy.generation)
                return None
            client = self.coord.client
            ranks = node_ranks(client, self.run_id, vacancy.generation, vacancy.node)
            group.workers = adopted_workers(vacancy, ranks, group.spec.local_world_size)
            incarnation = replacement_incarnation(
                client, self.run_id, vacancy.generation, vacancy.node
            )
            reopen(client, self.run_id, vacancy.generation, vacancy.node)
        except ConfigError:
            mark_vacant(store, self.run_id, vacancy)  # for a node that fits
            raise
        except Exception as exc:  # the job's store is gone: nothing left to join
            logger.warning("cannot take the place of lost node %d (%s)", vacancy.node, exc)
            return None
        placed: dict[str, Any] = {  # what torch's rendezvous would have set (typed None there)
            "store": self.gate.store,
            "group_rank": vacancy.node,
            "group_world_size": vacancy.nodes,
            "master_addr": vacancy.master_addr,
            "master_port": vacancy.master_port,
        }
        for name, value in placed.items():
            setattr(group, name, value)
        logger.warning(
            "took the place of lost node %d of generation %d: ranks %s, incarnation %d",
            vacancy.node,
            vacancy.generation,
            [w.global_rank for w in group.workers],
            incarnation,
        )
        return joined, incarnation

    def enter(self, group: WorkerGroup, joined: Generation) -> Place:
        """After the rendezvous (or :meth:`take_vacancy`): this node's :class:`Place`; its
        ranks published, the gate following the generation, older vacancies dropped (group
        rank 0)."""
        node, client = group.group_rank or 0, self.coord.client
        self.place = Place(
            run_id=self.run_id,
            generation=joined.generation,
            node=node,
            nodes=group.group_world_size or 1,
            world_size=group.workers[0].world_size if group.workers else 0,
            ranks=tuple(w.global_rank for w in group.workers),
            store_addr=joined.addr,
            master_addr=str(group.master_addr),
            master_port=int(group.master_port or 0),
        )
        self.eviction = None
        self.reached_again = False
        publish_ranks(client, self.run_id, joined.generation, node, self.place.ranks)
        if self.gate is not None:
            self.gate.follow(client, joined.generation)
            if node == 0:
                drop_vacancies(self.gate.store, self.run_id, before=joined.generation)
        return self.place

    def heartbeat(self) -> NodeRing:
        """This node's heartbeat in the current generation
        (:func:`~trainguard.launch.heartbeat.node_ring`), calling back into this watch."""
        place = self.place
        assert place is not None and self.coord.client is not None
        return node_ring(
            self.coord.client,
            run_id=place.run_id,
            generation=place.generation,
            node=place.node,
            nodes=place.nodes,
            interval=self.options.heartbeat_interval,
            timeout=self.options.heartbeat_timeout,
            on_lost=lambda node: self.lost(place, node),
            on_back=lambda node: self.back(place, node),
            on_evicted=lambda: self.evicted(place),
            on_reachable=self._reachable,
        )

    def _reachable(self) -> None:
        self.reached_again = True

    def lost(self, place: Place, node: int) -> None:
        """This agent declared ``node`` of ``place.generation`` lost (exactly one agent does):
        each of its ranks is gone, ``launch_node_lost``, the exit barrier no longer waits for
        it, its group rank is offered to a replacement."""
        client, gen = self.coord.client, place.generation
        ranks = node_ranks(client, self.run_id, gen, node) or []
        cause = f"node {node} lost (no heartbeat for {self.options.heartbeat_timeout:g} s)"
        for rank in ranks:
            self.gone(rank, cause)
        self.log.emit("launch_node_lost", node=node, ranks=ranks, generation=gen)
        logger.warning("node %d (ranks %s) is lost: its workers are counted out", node, ranks)
        mark_lost(client, self.run_id, gen, node)
        if self.gate is not None:
            try:
                mark_vacant(self.gate.store, self.run_id, place.vacancy(node))
            except Exception as exc:  # the rendezvous store went with that node
                logger.warning(
                    "no replacement can take node %d's place: the rendezvous store is gone (%s)",
                    node,
                    exc,
                )
                _compat.stop_keepalive(self.gate.handler)

    def back(self, place: Place, node: int) -> None:
        """A replacement took lost ``node``'s place and beats as it."""
        self.log.emit("launch_node_back", node=node, generation=place.generation)
        logger.info("node %d is back (a replacement took its place)", node)

    def evicted(self, place: Place) -> None:
        """Another agent declared this node lost (it was cut off, or only slow): its ranks were
        counted out and the job went on without them. The agent stops its workers on its next
        tick and rejoins as a new node or leaves (``--tg-on-evicted``); it never restarts or
        ends the rest of the job (:attr:`eviction` says why)."""
        self.eviction = (
            f"node {place.node} was declared lost by another node (no heartbeat reached the "
            f"store for {self.options.heartbeat_timeout:g} s); its ranks were counted out and "
            "the job went on without them"
        )
        then = "rejoin as a new node" if self.options.on_evicted == "rejoin" else "leave the job"
        logger.error("%s: this node stops its workers to %s", self.eviction, then)

    def exit_barrier(self) -> None:
        """:func:`exit_barrier` for this node, with what it waited for in the log."""
        assert self.place is not None
        timeout = self.options.exit_barrier_timeout
        logger.info("workers finished; waiting up to %g s for the other nodes", timeout)
        start = time.monotonic()
        try:
            missing = exit_barrier(
                self.coord.client,
                self.place,
                timeout=timeout,
                poll=min(0.1, self.options.heartbeat_interval),
            )
        except Exception as exc:  # the store's host finished first and is gone
            logger.info("exit barrier ended by the store (%s)", exc)
            return
        waited = time.monotonic() - start
        if missing:
            logger.warning("exit barrier: nodes %s did not finish within %.1f s", missing, waited)
        else:
            logger.info("exit barrier: every node finished or was lost (%.2f s)", waited)
