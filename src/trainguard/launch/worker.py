"""What a worker started by ``trainguard launch`` can ask of its launcher."""

from __future__ import annotations

import os

from trainguard import _env
from trainguard.errors import ConfigError

__all__ = ["escalate"]


def escalate(reason: str, *, timeout: float = 30.0) -> None:
    """Ask the launcher to restart the whole job (every worker on every node, a new rendezvous
    and a new generation), for a state in-process restart cannot recover from.

    Any worker may call it, any number of times (the first reason is kept). It returns at once;
    every agent sees the request on its next monitor tick and stops its workers, this one
    included. The job restarts only while torchrun's ``--max-restarts`` has restarts left;
    else it ends with a failure. Needs ``TRAINGUARD_STORE_ADDR``, ``TRAINGUARD_GENERATION``
    and ``TORCHELASTIC_RUN_ID``, which the launcher sets; ``timeout`` bounds the connection to
    the coordination store (seconds).
    """
    from trainguard.coord.store import connect
    from trainguard.launch._keys import escalate_key

    settings = _env.settings()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if settings.store_addr is None or settings.generation is None or not run_id:
        raise ConfigError(
            "escalate() works only in a worker started by `trainguard launch` (it needs "
            "TRAINGUARD_STORE_ADDR, TRAINGUARD_GENERATION and TORCHELASTIC_RUN_ID); start the "
            "job with trainguard launch, or end the process with a non-zero exit code instead"
        )
    host, port = settings.store_addr
    store = connect(host, port, timeout=timeout)
    store.compare_set(escalate_key(run_id, settings.generation), "", reason or "escalate()")
