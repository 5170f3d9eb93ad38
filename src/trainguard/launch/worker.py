"""What a worker started by ``trainguard launch`` can ask of its launcher."""

from __future__ import annotations

from trainguard.coord.escalation import ask_launcher

__all__ = ["escalate"]


def escalate(reason: str, *, timeout: float = 30.0) -> None:
    """Ask the launcher to restart the whole job (every worker on every node, a new rendezvous
    and a new generation), for a state in-process restart cannot recover from.

    Any worker may call it, any number of times (the first reason is kept). It returns at once;
    every agent sees the request on its next monitor tick and stops its workers, this one
    included. The job restarts only while torchrun's ``--max-restarts`` has restarts left;
    else it ends with a failure. Needs ``TRAINGUARD_STORE_ADDR``, ``TRAINGUARD_GENERATION``
    and ``TORCHELASTIC_RUN_ID``, which the launcher sets; ``timeout`` bounds the connection to
    the coordination store (seconds). The protocol: :mod:`trainguard.coord.escalation`.
    """
    ask_launcher(reason or "escalate()", timeout=timeout)
