"""Where the copies of each rank's part live: :class:`CliqueReplication`.

Ranks form *cliques* of ``factor`` members spaced ``jump`` apart; each member keeps the parts of
every member of its clique. With ``jump`` equal to the ranks per node (the default, from
``LOCAL_WORLD_SIZE``), the members of a clique sit on different nodes, so losing one node loses
at most one copy of any part::

    world 8, 4 ranks per node, factor 2, jump 4:   cliques {0,4} {1,5} {2,6} {3,7}
    world 8, factor 2, jump 1:                     cliques {0,1} {2,3} {4,5} {6,7}

Blocks of ``factor * jump`` ranks are laid out the same way. When the world size is not a
multiple of the block (after ranks were lost), the last cliques are smaller: their parts have
fewer copies, which :meth:`CliqueReplication.cliques` leaves for the caller to log.
"""

from __future__ import annotations

import dataclasses
import os

from trainguard.errors import ConfigError

__all__ = ["CliqueReplication", "no_replication", "ranks_per_node"]


def ranks_per_node() -> int:
    """Ranks per node as the launcher (torchrun and its kin) tells it: ``LOCAL_WORLD_SIZE``, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={value!r} is not a positive integer; fix the launcher's "
            "environment or pass CliqueReplication(jump=...)"
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class CliqueReplication:
    """Keep ``factor`` copies of every part, on ranks ``jump`` apart.

    Args:
        factor: copies of each part, the owner's included (1 = no replication).
        jump: distance between clique members in rank numbers (default: ranks per node, from
            ``LOCAL_WORLD_SIZE``, so that the copies land on other nodes).
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
                f"CliqueReplication(jump={self.jump!r}): use an integer >= 1, or None for the "
                "ranks per node"
            )

    def resolved_jump(self) -> int:
        return self.jump if self.jump is not None else ranks_per_node()

    def describe(self) -> str:
        """The setting as stored in every part (compared when loading)."""
        return f"CliqueReplication(factor={self.factor}, jump={self.resolved_jump()})"

    def cliques(self, world_size: int) -> list[list[int]]:
        """Every clique of a world of ``world_size`` ranks, members in rank order."""
        factor, jump = self.factor, self.resolved_jump()
        block = factor * jump
        out: list[list[int]] = []
        for base in range(0, world_size, block):
            for offset in range(jump):
                members = [base + offset + i * jump for i in range(factor)]
                members = [m for m in members if m < world_size]
                if members:
                    out.append(members)
        return out

    def replicates(self, world_size: int) -> bool:
        """Whether some clique of a world of ``world_size`` has more than one member."""
        return any(len(members) > 1 for members in self.cliques(world_size))

    def clique_of(self, rank: int, world_size: int) -> list[int]:
        """The members of ``rank``'s clique (``rank`` included), in rank order."""
        for members in self.cliques(world_size):
            if rank in members:
                return members
        raise ConfigError(f"rank {rank} is not in range(world_size={world_size})")


def no_replication() -> CliqueReplication:
    """The setting for ``replication=None``: one copy, the owner's."""
    return CliqueReplication(factor=1, jump=1)
