"""A whole-job restart asked of ``trainguard launch``: one key per generation, first reason wins.

In-process restart cannot cure every state (the job ended, the optimizer state is gone). Then a
worker, its Wrapper, or an agent asks the launcher to restart the whole job: every worker on every
node stops, a new rendezvous starts generation ``g + 1``, and training resumes from checkpoints.

Protocol (in the launcher's coordination store, under :func:`~trainguard.coord.keys.launch_prefix`):

1. Whoever asks writes its reason with ``compare_set(escalate_key(run, g), "", reason)``
   (:func:`escalate`, the one writer): the first reason stays, a later one changes nothing.
2. Every agent reads the key on its monitor tick (:func:`escalation_reason`; one ``check`` while there
   is none) and stops its workers; torchrun's ``--max-restarts`` decides whether ``g + 1`` starts.
3. A request to *end* the job (``fatal``: an error raised before the first round, such as a
   ``ConfigError``, which every new start would raise again) is the same key with its reason
   marked (:data:`CANNOT_START`, :func:`cannot_start`): every agent stops its workers and the
   job ends at once, with no respawn and no whole-job restart.

A worker reaches the store through what the launcher put in its environment
(``TRAINGUARD_STORE_ADDR``, ``TRAINGUARD_GENERATION``, ``TORCHELASTIC_RUN_ID``):
:func:`ask_launcher`, behind :func:`trainguard.launch.escalate` and the Wrapper that gives up.
Nothing here imports torch until a worker connects.
"""

from __future__ import annotations

import os

from trainguard import _env
from trainguard.coord.keys import escalate_key
from trainguard.coord.store import StoreLike, connect
from trainguard.errors import ConfigError

__all__ = ["CANNOT_START", "ask_launcher", "cannot_start", "escalate", "escalation_reason"]

#: the reason written when the caller gave none
DEFAULT_REASON = "escalation requested"
#: what the reason of a request to end the job (not to restart it) starts with
CANNOT_START = "[cannot start] "


def escalate(
    store: StoreLike, run_id: str, generation: int, reason: str, *, fatal: bool = False
) -> bool:
    """Ask for a whole-job restart of ``generation`` of run ``run_id`` in the launcher's
    coordination ``store`` (``fatal``: for the end of the job). True when this call's reason is
    the one kept (it came first)."""
    wanted = (CANNOT_START if fatal else "") + (reason or DEFAULT_REASON)
    kept: bytes = store.compare_set(escalate_key(run_id, generation), "", wanted)
    return kept == wanted.encode()


def escalation_reason(store: StoreLike, run_id: str, generation: int) -> str | None:
    """The reason of a whole-job restart asked for in ``generation``, or ``None``. One
    ``check`` when there is none."""
    key = escalate_key(run_id, generation)
    if not store.check([key]):
        return None
    reason: bytes = store.get(key)
    return reason.decode(errors="replace") or DEFAULT_REASON


def cannot_start(reason: str) -> str | None:
    """The error of a request to end the job (``escalate(..., fatal=True)``), or ``None`` for a
    whole-job restart's reason."""
    return reason[len(CANNOT_START) :] if reason.startswith(CANNOT_START) else None


def ask_launcher(reason: str, *, timeout: float = 30.0, fatal: bool = False) -> bool:
    """From a worker started by ``trainguard launch``: connect to the launcher's coordination
    store (``timeout`` seconds at most) and :func:`escalate` with ``reason`` (and ``fatal``).

    Raises :class:`~trainguard.errors.ConfigError` outside such a worker (it names the variables
    the launcher sets), :class:`~trainguard.errors.CoordinationError` when the store is out of
    reach."""
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
    return escalate(store, run_id, settings.generation, reason, fatal=fatal)
