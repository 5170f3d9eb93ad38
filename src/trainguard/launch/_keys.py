"""Key names the launcher's agents keep in the stores, all under ``trainguard/launch/<run_id>/``.

In the coordination store: ``generation`` (a counter), ``escalate/g<gen>`` (a whole-job restart
was asked for), and per generation ``g<gen>/node/<node>`` (a node's heartbeat),
``g<gen>/ranks/<node>`` (the global ranks of a node's workers), ``g<gen>/exit/<node>`` (the
node's workers finished: ``done``, or it was lost: ``lost``; the agents' exit barrier) and
``g<gen>/replaced/<node>`` (how many replacement nodes took the node's place: a counter). In the rendezvous store (the one
a node reaches before any rendezvous round): ``vacant`` (the group ranks of lost nodes that a
replacement node may take).
"""

from __future__ import annotations

__all__ = [
    "escalate_key",
    "exit_key",
    "generation_key",
    "node_key",
    "prefix",
    "ranks_key",
    "replaced_key",
    "vacant_key",
]


def prefix(run_id: str) -> str:
    """``trainguard/launch/<run_id>/``: every launcher key of one run starts with it."""
    return f"trainguard/launch/{run_id}/"


def generation_key(run_id: str) -> str:
    return prefix(run_id) + "generation"


def escalate_key(run_id: str, generation: int) -> str:
    return f"{prefix(run_id)}escalate/g{generation}"


def node_key(run_id: str, generation: int, node: int) -> str:
    return f"{prefix(run_id)}g{generation}/node/{node}"


def ranks_key(run_id: str, generation: int, node: int) -> str:
    return f"{prefix(run_id)}g{generation}/ranks/{node}"


def exit_key(run_id: str, generation: int, node: int) -> str:
    return f"{prefix(run_id)}g{generation}/exit/{node}"


def replaced_key(run_id: str, generation: int, node: int) -> str:
    return f"{prefix(run_id)}g{generation}/replaced/{node}"


def vacant_key(run_id: str) -> str:
    return prefix(run_id) + "vacant"
