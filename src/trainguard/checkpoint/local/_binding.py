"""Binding a :class:`~.manager.LocalCheckpointManager` to a round: this rank and the world
size (:func:`dist_ranks`), where its copies go (:func:`placement`: each rank's host, its
clique), and the round's gathers through the store (:class:`RoundGather`), which every rank
calls in the same order. What the manager keeps across rounds is in :mod:`._resources`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainguard.checkpoint._link import RoundWatch, StoreLink
from trainguard.checkpoint.local.replication import CliqueReplication, this_host
from trainguard.coord import decode, encode, gather
from trainguard.errors import ConfigError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)


def round_hosts(
    replication: CliqueReplication,
    link: StoreLink | None,
    store: Store | None,
    rank: int,
    world_size: int,
    timeout: float,
) -> list[str] | None:
    """Each rank's host in this round, when ``replication`` places copies by host: a gather
    of :func:`~.replication.this_host` through the store (every rank binds together), once per
    round. None for placement by rank arithmetic."""
    if not replication.by_host:
        return None
    if link is None or store is None:
        return [this_host()] * world_size  # one rank (world_size is 1)
    got = gather(
        store,
        f"{link.prefix}/hosts",
        this_host(),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        what="host names",
        hint="every rank must build (or bind) its LocalCheckpointManager together",
    )
    return [str(got[r]) for r in range(world_size)]


def clique_of(
    replication: CliqueReplication,
    rank: int,
    world_size: int,
    watch: RoundWatch,
    hosts: list[str] | None,
) -> list[int]:
    """``rank``'s clique in a world of ``world_size`` (``hosts``: each rank's, when placing by
    host); warns when it is short of members (unless not bound yet: built before
    torch.distributed, it binds to the real world later)."""
    cliques = replication.cliques(world_size, hosts)
    clique = next((c for c in cliques if rank in c), None)
    if clique is None:
        raise ConfigError(f"rank {rank} is not in range(world_size={world_size})")
    short = sorted(r for c in cliques if len(c) < replication.factor for r in c)
    # said once for the whole world (by the lowest rank concerned) and once per process, not
    # by every rank in every round
    key = (replication.factor, world_size, tuple(short), hosts is not None)
    if short and rank == short[0] and not watch.unbound and key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "local checkpoints: %d of %d rank(s) %s are in replication cliques smaller than "
            "factor %d (%s): their parts have fewer copies",
            len(short),
            world_size,
            _ranks(short),
            replication.factor,
            "placed by rank arithmetic"
            if hosts is None
            else f"{len(set(hosts))} host(s); copies go only to other hosts",
        )
    return clique


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}]"


#: the short cliques warned about in this process: (factor, world size, ranks, by host)
_WARNED: set[tuple[int, int, tuple[int, ...], bool]] = set()


def dist_ranks() -> tuple[int, int]:
    """This rank and the world size from torch.distributed (0 and 1 when not initialized)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def placement(
    replication: CliqueReplication,
    link: StoreLink | None,
    store: Store | None,
    rank: int,
    world_size: int,
    timeout: float,
    watch: RoundWatch,
) -> tuple[list[str] | None, list[int], bool]:
    """Where this round's copies go, for every rank together when binding: each rank's host
    (:func:`round_hosts`), ``rank``'s clique (:func:`clique_of`) and whether any part is copied
    at all (never without a link to the other ranks)."""
    hosts = round_hosts(replication, link, store, rank, world_size, timeout)
    clique = clique_of(replication, rank, world_size, watch, hosts)
    return hosts, clique, link is not None and replication.replicates(world_size, hosts)


class RoundGather:
    """Every rank's value through the round's store (every rank calls it in the same order:
    the n-th call of each rank meets the others' n-th, under a key of its own).

    One per round; :attr:`calls` counts its calls (a restore from memory checks that no
    exchange happened since ``find_latest``). Without a link (one rank) it returns this rank's
    value, encoded and decoded as the store would.
    """

    def __init__(
        self,
        link: StoreLink | None,
        store: Store | None,
        *,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> None:
        self._link, self._store = link, store
        self._rank, self._world_size, self._timeout = rank, world_size, timeout
        self.calls = 0

    def __call__(self, what: str, value: Any) -> dict[int, Any]:
        """Every rank's ``value``, by rank; ``what`` names the exchange in its key."""
        self.calls += 1
        if self._link is None or self._store is None:
            return {self._rank: decode(encode(value))}
        return gather(
            self._store,
            f"{self._link.prefix}/{what}/{self.calls}",
            value,
            rank=self._rank,
            world_size=self._world_size,
            timeout=self._timeout,
            what="what they hold",
            hint="every rank must call the same LocalCheckpointManager method together",
        )
