"""The one place that reads ``TRAINGUARD_*`` environment variables.

Every variable trainguard understands is declared in :data:`VARIABLES` with its meaning.
:func:`settings` reads them into a frozen :class:`Settings`; it is cheap and reads the
environment on every call, so a variable set after import still counts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

from trainguard._addr import parse_addr
from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)

PREFIX = "TRAINGUARD_"
_warned: set[str] = set()  # unknown names already reported, so each is logged once

#: name -> meaning, for every variable the library reads.
VARIABLES: dict[str, str] = {
    "TRAINGUARD_EVENTS_DIR": "directory for the structured event log (one file per process)",
    "TRAINGUARD_STORE_ADDR": "host:port of an existing coordination store to connect to",
    "TRAINGUARD_JOB_ID": "job token that separates two jobs sharing one store",
    "TRAINGUARD_JOB_SECRET": "per-job secret in every store key (16+ of A-Z a-z 0-9 _ -); the "
    "same on every node",
    "TRAINGUARD_INSECURE": "'1': let a job on several hosts run without TRAINGUARD_JOB_SECRET (the "
    "secret is then handed over in the store, where any host that reaches it can read it)",
    "TRAINGUARD_GENERATION": "global generation of a job under `trainguard launch` (0, 1, ..: "
    "bumped at each whole-job restart); set by the launcher",
    "TRAINGUARD_INCARNATION": "how many times the launcher respawned this worker's slot in this "
    "generation (0 for its first process); set by the launcher",
    "TRAINGUARD_AGENT": "socket name of the launcher's sidecar service for this worker; set by "
    "the launcher",
    "TRAINGUARD_HOST_NAME": "the host name a rank reports for the placement of local checkpoint "
    "copies (CliqueReplication by host) and to in-process restart (fault attribution, "
    "Quarantine); default socket.gethostname()",
    "TRAINGUARD_QUARANTINE": "the quarantine policy `trainguard launch --tg-quarantine-after` "
    "gives its workers' Wrapper (JSON: after, window, readmit, probe_timeout, file, node_dir); "
    "set by the launcher",
    "TRAINGUARD_OVERWRITE_KILL_AT": "tests only: SIGKILL this process when a checkpoint "
    "overwrite reaches this step (uncommitted, committed, old-moved, new-moved)",
    "TRAINGUARD_PREEMPTION_GRACE": "seconds from a SIGTERM (preemption) to the end of the job, "
    "to stop at an agreed step and save it (default 60); `trainguard launch "
    "--tg-preemption-grace` sets it for its workers",
    "TRAINGUARD_DEMO_MODEL_MIB": "`trainguard demo` only: pad the demo model's checkpointed state "
    "to about this many MiB per rank (0: no padding); set by `trainguard demo --model-mib`",
}

#: variables of removed behaviour -> (the values that name what is left, ignored; why any
#: other value is refused)
REMOVED: dict[str, tuple[frozenset[str], str]] = {
    "TRAINGUARD_SIDECAR": (
        frozenset({"node"}),
        "a rank is watched by its node's watcher process (or by the agent of `trainguard "
        "launch`), never by a sidecar process of its own",
    ),
    "TRAINGUARD_NODE_ARRIVAL": (
        frozenset({"1"}),
        "the node watcher (or the agent of `trainguard launch`) always arrives at the barriers "
        "for its ranks, and a rank without one arrives by itself in the same pooled records",
    ),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Values of the ``TRAINGUARD_*`` variables (``None`` where unset or empty)."""

    events_dir: str | None = None
    store_addr: tuple[str, int] | None = None
    job_id: str | None = None
    job_secret: str | None = None
    insecure: bool = False
    generation: int | None = None
    incarnation: int = 0
    agent: str | None = None
    demo_model_mib: int = 0
    host_name: str | None = None
    overwrite_kill_at: str | None = None
    preemption_grace: float = 60.0
    quarantine: dict[str, object] | None = None


def _parse_addr(value: str) -> tuple[str, int]:
    try:
        return parse_addr(value)
    except ConfigError as exc:
        raise ConfigError(f"TRAINGUARD_STORE_ADDR must be HOST:PORT: {exc}, or unset it") from None


def _check_secret(value: str) -> str:
    if (
        len(value) < 16
        or not value.replace("-", "").replace("_", "").isalnum()
        or not value.isascii()
    ):
        raise ConfigError(
            "TRAINGUARD_JOB_SECRET must be at least 16 of A-Z a-z 0-9 _ -; set it to the output "
            "of `openssl rand -hex 16`, the same on every node"
        )
    return value


def _count(name: str, value: str, setter: str = "the launcher") -> int:
    if not (value.isascii() and value.isdigit()):
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 0 ({setter} sets it); unset it"
        )
    return int(value)


def _flag(name: str, value: str | None) -> bool:
    if value in (None, "0"):
        return False
    if value == "1":
        return True
    raise ConfigError(f"{name}={value!r} must be 1 or 0; set one of them or unset it")


_KILL_POINTS = ("uncommitted", "committed", "old-moved", "new-moved")


def _kill_point(value: str) -> str:
    if value not in _KILL_POINTS:
        raise ConfigError(
            f"TRAINGUARD_OVERWRITE_KILL_AT={value!r} must be one of {', '.join(_KILL_POINTS)} "
            "(a test's fault injection); unset it"
        )
    return value


def _grace(value: str) -> float:
    try:
        grace = float(value)
    except ValueError:
        grace = -1.0
    if not 0 < grace < float("inf"):
        raise ConfigError(
            f"TRAINGUARD_PREEMPTION_GRACE={value!r} must be a number of seconds > 0 (e.g. 60, "
            "shorter than the scheduler's warning before it kills the job); set one or unset it"
        )
    return grace


_QUARANTINE_KEYS = {"after", "window", "readmit", "probe_timeout", "file", "node_dir"}


def _quarantine(value: str) -> dict[str, object]:
    try:
        spec = json.loads(value)
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or set(spec) != _QUARANTINE_KEYS:
        raise ConfigError(
            f"TRAINGUARD_QUARANTINE={value[:200]!r} must be the JSON object `trainguard launch "
            f"--tg-quarantine-after` sets (keys {', '.join(sorted(_QUARANTINE_KEYS))}); unset it"
        )
    return spec


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the ``TRAINGUARD_*`` variables from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    for name, (same, why) in REMOVED.items():
        value = env.get(name, "").strip()
        if value and value not in same:
            raise ConfigError(f"{name}={value!r} is no longer supported: {why}; unset it")
    unknown = sorted(
        k
        for k in env
        if k.startswith(PREFIX) and k not in VARIABLES and k not in REMOVED and k not in _warned
    )
    if unknown:
        _warned.update(unknown)
        logger.warning(
            "ignoring unknown environment variable(s) %s; known: %s",
            ", ".join(unknown),
            ", ".join(sorted(VARIABLES)),
        )

    def get(name: str) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    addr = get("TRAINGUARD_STORE_ADDR")
    generation = get("TRAINGUARD_GENERATION")
    incarnation = get("TRAINGUARD_INCARNATION")
    mib = get("TRAINGUARD_DEMO_MODEL_MIB")
    return Settings(
        events_dir=get("TRAINGUARD_EVENTS_DIR"),
        store_addr=_parse_addr(addr) if addr else None,
        job_id=get("TRAINGUARD_JOB_ID"),
        job_secret=_check_secret(secret) if (secret := get("TRAINGUARD_JOB_SECRET")) else None,
        insecure=_flag("TRAINGUARD_INSECURE", get("TRAINGUARD_INSECURE")),
        generation=_count("TRAINGUARD_GENERATION", generation) if generation else None,
        incarnation=_count("TRAINGUARD_INCARNATION", incarnation) if incarnation else 0,
        agent=get("TRAINGUARD_AGENT"),
        demo_model_mib=_count("TRAINGUARD_DEMO_MODEL_MIB", mib, "trainguard demo --model-mib")
        if mib
        else 0,
        host_name=get("TRAINGUARD_HOST_NAME"),
        overwrite_kill_at=_kill_point(kill)
        if (kill := get("TRAINGUARD_OVERWRITE_KILL_AT"))
        else None,
        preemption_grace=_grace(grace) if (grace := get("TRAINGUARD_PREEMPTION_GRACE")) else 60.0,
        quarantine=_quarantine(spec) if (spec := get("TRAINGUARD_QUARANTINE")) else None,
    )
