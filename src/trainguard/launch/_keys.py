"""Key names the launcher's agents keep in the stores, all under ``trainguard/launch/<run_id>/``.

In the coordination store: ``generation`` (a counter), ``escalate/g<gen>`` (a whole-job restart
was asked for), and per generation ``g<gen>/node/<node>`` (a node's heartbeat),
``g<gen>/ranks/<node>`` (the global ranks of a node's workers), ``g<gen>/exit/<node>`` (the
node's workers finished: ``done``, or it was lost: ``lost``; the agents' exit barrier) and
``g<gen>/replaced/<node>`` (how many replacement nodes took the node's place: a counter). In the rendezvous store (the one
a node reaches before any rendezvous round): ``vacant`` (the group ranks of lost nodes that a
replacement node may take).

The prefix (:func:`~trainguard.coord.keys.launch_prefix`) and the escalation key are named in
:mod:`trainguard.coord.keys`: a worker's Wrapper asks for a whole-job restart too
(:mod:`trainguard.coord.escalation`), and it stands below this package.
"""

from __future__ import annotations

from trainguard.coord.keys import escalate_key
from trainguard.coord.keys import launch_prefix as prefix

__all__ = [
    "escalate_key",
    "exit_key",
    "generation_key",
    "node_key",
    "prefix",
    "published_key",
    "ranks_key",
    "replaced_key",
    "vacant_key",
]


def generation_key(run_id: str) -> str:
    return prefix(run_id) + "generation"


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


def published_key() -> str:
    """Where agent 0 publishes the coordination store and the generation, in the round's
    rendezvous store (torch gives each round a prefix of its own)."""
    return prefix("coord")
