"""Where the copies of each rank's part live: :class:`CliqueReplication`.

Ranks form *cliques* of ``factor`` members; each member keeps the parts of every member of its
clique, so a part survives as long as one member's local root does.

**By host** (the default, ``jump=None``): the members of a clique sit on ``factor`` different
hosts whenever the round has that many, whatever the rank numbering. Every rank reports the host
it runs on in the current round (``socket.gethostname()``, or ``TRAINGUARD_HOST_NAME``) when the
manager binds to the round, and every rank computes the same cliques from that map
(:func:`host_cliques`): hosts are taken in name order, ranks of a host in rank order; each clique
takes the next rank of each of the ``factor`` hosts with the most ranks left (ties: host name).
After spares took over ranks of other hosts (``FillGaps``), ranks are no longer numbered host by
host, and the cliques follow the hosts, not the numbers::

    h1: ranks 0 1, h2: ranks 4 5 (spares), h3: ranks 2 3, factor 2:   {0,4} {1,2} {3,5}
    h1: ranks 0 1 2 3, h2: rank 4, factor 2:                          {0,4} {1} {2} {3}

A clique never has two members on one host: a second copy on the owner's host would cost memory
and bandwidth and not survive that host. So on one host nothing is copied, and where one host
has more ranks than all others together, some of its ranks keep their only copy.

**By arithmetic** (``jump=N``, as before host placement): members are ``jump`` rank numbers
apart, which puts them on different hosts only while ranks are numbered host by host with
``jump`` ranks per host::

    world 8, factor 2, jump 4:   cliques {0,4} {1,5} {2,6} {3,7}
    world 8, factor 2, jump 1:   cliques {0,1} {2,3} {4,5} {6,7}

Blocks of ``factor * jump`` ranks are laid out the same way. Either way, cliques that come out
smaller than ``factor`` (the world size is not a multiple of it or of the block; too few
hosts) mean fewer copies of their parts, which the manager logs.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Sequence

from trainguard import _env
from trainguard.errors import ConfigError

__all__ = ["CliqueReplication", "compatible", "host_cliques", "no_replication", "this_host"]

_SETTING = re.compile(r"CliqueReplication\(factor=(\d+), (jump=\d+|by host)\)")


def this_host() -> str:
    """The host name this rank reports for placement: ``TRAINGUARD_HOST_NAME``, else
    ``socket.gethostname()``."""
    return _env.settings().host_name or socket.gethostname()


def host_cliques(hosts: Sequence[str], factor: int) -> list[list[int]]:
    """Cliques of ``factor`` ranks on distinct hosts where possible; ``hosts[r]`` is rank ``r``'s.

    Deterministic in ``hosts``: every rank computes the same cliques from the same map. Each
    clique takes the lowest rank left of each of the ``factor`` hosts with the most ranks left
    (ties broken by host name); never two ranks of one host (a copy on the owner's host does
    not survive that host), so with fewer hosts left the clique is smaller. Members in rank
    order, cliques by their first member.
    """
    left: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        left.setdefault(host, []).append(rank)
    for ranks in left.values():
        ranks.reverse()  # pop() takes the lowest rank
    names = sorted(left)
    out: list[list[int]] = []
    while any(left.values()):
        live = sorted((h for h in names if left[h]), key=lambda h: -len(left[h]))  # stable
        out.append(sorted(left[h].pop() for h in live[:factor]))
    return sorted(out)


def compatible(saved: str, current: str) -> bool:
    """Whether an iteration saved with setting ``saved`` loads without
    ``allow_replication_change`` under ``current`` (both as :meth:`CliqueReplication.describe`
    writes them): the same setting, or the same ``factor`` where either places by host (the
    default before host placement was ``jump`` = ranks per node; where copies sit does not
    change what can be loaded)."""
    if saved == current:
        return True
    a, b = _SETTING.fullmatch(saved), _SETTING.fullmatch(current)
    if a is None or b is None or a[1] != b[1]:
        return False
    return "by host" in (a[2], b[2])


@dataclasses.dataclass(frozen=True)
class CliqueReplication:
    """Keep ``factor`` copies of every part, on different hosts (see the module docstring).

    Args:
        factor: copies of each part, the owner's included (1 = no replication).
        jump: None (default): place the copies by the host each rank is on in the current round.
            An integer: the older placement by rank arithmetic, members ``jump`` rank numbers
            apart (``jump=1``: neighbours; ``jump`` = ranks per host: other hosts as long as
            ranks are numbered host by host).
    """

    factor: int = 2
    jump: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 1:
            raise ConfigError(f"CliqueReplication(factor={self.factor!r}): use an integer >= 1")
        if self.jump is not None and (
            isinstance(self.jump, bool) or not isinstance(self.jump, int) or self.jump < 1
        ):
            raise ConfigError(
                f"CliqueReplication(jump={self.jump!r}): use an integer >= 1, or None to place "
                "copies by host"
            )

    @property
    def by_host(self) -> bool:
        """Whether the copies are placed by host (``jump`` is None)."""
        return self.jump is None

    def describe(self) -> str:
        """The setting as stored in every part (compared when loading, see :func:`compatible`)."""
        where = "by host" if self.jump is None else f"jump={self.jump}"
        return f"CliqueReplication(factor={self.factor}, {where})"

    def cliques(self, world_size: int, hosts: Sequence[str] | None = None) -> list[list[int]]:
        """Every clique of a world of ``world_size`` ranks, members in rank order.

        ``hosts``: each rank's host in this round (``hosts[r]``), needed when placing by host.
        """
        if self.jump is None:
            if hosts is None or len(hosts) != world_size:
                raise ConfigError(
                    f"placement by host needs the host of each of the {world_size} ranks "
                    "(hosts=...); or pass CliqueReplication(jump=...) for rank arithmetic"
                )
            return host_cliques(hosts, self.factor)
        factor, jump = self.factor, self.jump
        block = factor * jump
        out: list[list[int]] = []
        for base in range(0, world_size, block):
            for offset in range(jump):
                members = [base + offset + i * jump for i in range(factor)]
                members = [m for m in members if m < world_size]
                if members:
                    out.append(members)
        return out

    def replicates(self, world_size: int, hosts: Sequence[str] | None = None) -> bool:
        """Whether some clique of a world of ``world_size`` has more than one member (placing
        by host without ``hosts``: whether it may)."""
        if self.jump is None and hosts is None:
            return self.factor > 1 and world_size > 1
        return any(len(members) > 1 for members in self.cliques(world_size, hosts))

    def clique_of(
        self, rank: int, world_size: int, hosts: Sequence[str] | None = None
    ) -> list[int]:
        """The members of ``rank``'s clique (``rank`` included), in rank order."""
        for members in self.cliques(world_size, hosts):
            if rank in members:
                return members
        raise ConfigError(f"rank {rank} is not in range(world_size={world_size})")


def no_replication() -> CliqueReplication:
    """The setting for ``replication=None``: one copy, the owner's."""
    return CliqueReplication(factor=1, jump=1)
