"""The one place that reads ``TRAINGUARD_*`` environment variables.

Every variable trainguard understands is declared in :data:`VARIABLES` with its meaning.
:func:`settings` reads them into a frozen :class:`Settings`; it is cheap and reads the
environment on every call, so a variable set after import still counts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)

PREFIX = "TRAINGUARD_"
_warned: set[str] = set()  # unknown names already reported, so each is logged once

#: name -> meaning, for every variable the library reads.
VARIABLES: dict[str, str] = {
    "TRAINGUARD_EVENTS_DIR": "directory for the structured event log (one file per process)",
    "TRAINGUARD_STORE_ADDR": "host:port of an existing coordination store to connect to",
    "TRAINGUARD_JOB_ID": "job token that separates two jobs sharing one store",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Values of the ``TRAINGUARD_*`` variables (``None`` where unset or empty)."""

    events_dir: str | None = None
    store_addr: tuple[str, int] | None = None
    job_id: str | None = None


def _parse_addr(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"TRAINGUARD_STORE_ADDR={value!r} is not HOST:PORT; set it like '10.0.0.1:29500' or unset it"
        )
    return host, int(port)


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the ``TRAINGUARD_*`` variables from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    unknown = sorted(
        k for k in env if k.startswith(PREFIX) and k not in VARIABLES and k not in _warned
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
    return Settings(
        events_dir=get("TRAINGUARD_EVENTS_DIR"),
        store_addr=_parse_addr(addr) if addr else None,
        job_id=get("TRAINGUARD_JOB_ID"),
    )
