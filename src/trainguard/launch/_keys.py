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

import hashlib

from trainguard import _env

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


def prefix(run_id: str) -> str:
    """``trainguard/launch/<run_id>/[<secret digest>/]``: every launcher key of one run starts
    with it. With ``TRAINGUARD_JOB_SECRET`` set (required for a job on several hosts; the launcher
    hands it to its workers) the prefix carries a digest of it, so that nobody who can reach the
    stores but does not know the secret can name, read or forge a key of the job."""
    secret = _env.settings().job_secret
    if secret is None:
        return f"trainguard/launch/{run_id}/"
    digest = hashlib.sha256(f"trainguard-launch/{run_id}/{secret}".encode()).hexdigest()[:32]
    return f"trainguard/launch/{run_id}/{digest}/"


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


def published_key() -> str:
    """Where agent 0 publishes the coordination store and the generation, in the round's
    rendezvous store (torch gives each round a prefix of its own)."""
    return prefix("coord")
