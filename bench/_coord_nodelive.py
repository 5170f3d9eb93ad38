"""Node liveness in the scale simulation: one :class:`NodeRing` per simulated node.

Under node arrival (``arrival=True``) the node watcher beats one key for its node and reads the
node keys after it (:mod:`trainguard.coord.node_ring`), instead of a
:class:`~trainguard.restart.sidecar._watch.Watch` per rank beating and reading for its rank.
:func:`members` builds, for the ranks of one worker, one :class:`Member` per node: the
library's own :class:`NodeRing` on that node's one connection, shaped like the per-rank
watches that :meth:`bench._coord_worker._Worker._drive` steps (``rank`` is the node's leader,
``ranks`` all of its ranks, ``ring`` what is stepped). A silent node is declared by the ring
(its ranks go to ``ring.gone``, which the driver reads); no notice is written here (the death
notices' cost is measured by the notice rounds).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used: the worker runs whatever trainguard is on the path
    from trainguard.coord.keys import Keyspace


class Member:
    """One simulated node's liveness: its leader, its ranks, its ring."""

    def __init__(
        self,
        store: Any,
        keys: Keyspace,
        ranks: tuple[int, ...],
        times: tuple[float, float],
        n: int,
        roster: tuple[int, ...],
    ) -> None:
        from trainguard.coord.node_ring import WINDOW, NodeRing

        self.rank, self.ranks = min(ranks), ranks
        self.done = threading.Event()
        self.notices: list[threading.Thread] = []
        self.ring = NodeRing(
            store,
            keys.node_heartbeat,
            position=lambda: (ranks, n, roster),
            interval=times[0],
            timeout=times[1],
            window=WINDOW,
            on_silent=lambda *_: None,
        )

    def warm(self) -> None:
        """Make the observed node keys exist once (as a watcher does at its first look)."""
        _, n, roster = self.ring.position()
        self.ring.refresh(self.ranks)
        self.ring.ensure(self.ring.window_of(n, roster))

    def close(self) -> None:
        del self.ring.store


def members(
    cfg: Any,
    keys: Keyspace,
    mine: list[int],
    local: int,
    round_: int,
    roster: tuple[int, ...],
    beats: dict[int, Any],
) -> list[Member]:
    """A :class:`Member` per node of the ranks ``mine`` (``local`` ranks a node), each on its
    node's connection of ``beats`` (node -> client)."""
    by_node: dict[int, list[int]] = {}
    for r in mine:
        by_node.setdefault(r // local, []).append(r)
    times = (cfg.heartbeat_interval, cfg.heartbeat_timeout)
    return [
        Member(beats[node], keys, tuple(ranks), times, round_, roster)
        for node, ranks in sorted(by_node.items())
    ]


__all__ = ["Member", "members"]
