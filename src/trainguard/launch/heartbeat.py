"""The agents' heartbeat: their node ring, and the ranks of a node published beside it.

One :class:`~trainguard.coord.node_ring.NodeRing` per agent and generation (:func:`node_ring`),
with lost marks (its protocol is in :mod:`trainguard.coord.node_ring`): a member per node, its
group rank, beating ``trainguard/launch/<run_id>/g<gen>/node/<node>``; each agent reads the next
two live nodes after it (the target it judges and a backup whose clock it keeps) and marks a
silent target lost, so that exactly one agent declares it (``on_lost``); a node that never beat
is judged too (:func:`~trainguard.coord.ring_judge.unbeaten`). Every agent starts its own right
after the rendezvous, with the same run id, generation, nodes, interval and timeout.

Every agent publishes the global ranks of its workers with :func:`publish_ranks` right after
its rendezvous, before its heartbeat starts; the agent that declared a node lost, and the
replacement node that takes its place, read them with :func:`node_ranks`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from trainguard import _torchcompat
from trainguard._timeouts import Timeout, seconds, shorter
from trainguard.coord.node_ring import NodeRing
from trainguard.coord.ring_judge import unbeaten
from trainguard.coord.store import StoreLike
from trainguard.errors import ConfigError, CoordinationError
from trainguard.launch._keys import node_key, ranks_key

__all__ = ["node_ranks", "node_ring", "publish_ranks"]


def node_ring(
    store: StoreLike,
    *,
    run_id: str,
    generation: int,
    node: int,
    nodes: int,
    interval: Timeout = 1.0,
    timeout: Timeout = 10.0,
    on_lost: Callable[[int], None],
    on_back: Callable[[int], None] | None = None,
    on_evicted: Callable[[], None] | None = None,
    on_reachable: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> NodeRing:
    """Agent ``node``'s member of the node ring of ``generation`` (module docstring), on a
    connection of its own (a clone of ``store``; afresh after a failed beat). ``timeout`` must
    exceed twice ``interval``; ``on_lost`` runs once in the job per node declared lost."""
    if not run_id:
        raise ConfigError("run_id must be a non-empty string: pass the rendezvous run id")
    for name, value in (("generation", generation), ("nodes", nodes), ("node", node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r} must be an int >= 0")
    if not 0 <= node < nodes:
        raise ConfigError(f"node={node} must be a group rank in 0..{nodes - 1} (nodes={nodes})")
    interval_s, timeout_s = seconds("interval", interval), seconds("timeout", timeout)
    shorter(
        "2*interval",
        2 * interval_s,
        "timeout",
        timeout_s,
        "a node must miss at least two beats before it is declared lost",
    )
    everyone = tuple(range(nodes))

    def connection() -> Any:
        return _torchcompat.clone_store(store) or store

    return NodeRing(
        connection(),
        lambda n: node_key(run_id, generation, n),
        position=lambda: ((node,), generation, everyone),
        interval=interval_s,
        timeout=timeout_s,
        window=2,
        blank=unbeaten,
        on_lost=on_lost,
        on_back=on_back,
        on_evicted=on_evicted,
        on_reachable=on_reachable,
        connect=connection,
        clock=clock,
    )


def publish_ranks(
    store: StoreLike, run_id: str, generation: int, node: int, ranks: Sequence[int]
) -> None:
    """Every agent, after its rendezvous: the global ranks of ``node``'s workers (JSON list)."""
    store.set(ranks_key(run_id, generation, node), json.dumps([int(r) for r in ranks]))


def node_ranks(store: StoreLike, run_id: str, generation: int, node: int) -> list[int] | None:
    """The global ranks ``node`` published in ``generation``; ``None`` if it never did.

    Raises :class:`CoordinationError` for a value that is not a JSON list of ints."""
    key = ranks_key(run_id, generation, node)
    if not store.check([key]):
        return None
    raw = bytes(store.get(key))
    try:
        ranks = json.loads(raw)
    except ValueError:
        ranks = None
    if not isinstance(ranks, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ranks
    ):
        raise CoordinationError(
            f"garbage under {key} in the coordination store: {raw[:200]!r}; another program "
            "writes there: give this job its own run id (--rdzv-id)"
        )
    return ranks
