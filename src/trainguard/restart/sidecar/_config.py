"""What a rank tells the helper that watches it, and the helper's reply.

The rank's :class:`SidecarConfig` is one JSON line, over the helper's Unix socket or on the
stdin of the node watcher it starts (never on a command line, which every local user can
read); the helper answers with one JSON handshake line (:func:`handshake_reply`)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

from trainguard.coord.keys import Keyspace
from trainguard.restart.config import WrapperConfig
from trainguard.restart.policy._round import RoundPolicies


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


_CONVERT: dict[str, Callable[[Any], object]] = {
    "int": int,
    "float": float,
    "str": str,
    "str | None": _optional_str,
    "bool": bool,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    """The sidecar's configuration (built by the training process, read by the sidecar).

    Attributes:
        rank, world: the training process's initial rank and the initial world size.
        job, call, secret: the wrapped call's keyspace (:attr:`keys`).
        host, port: the coordination store.
        log_dir: where the sidecar logs and records events (None: no events, and the log goes
            to this user's private directory, see :func:`~trainguard.restart.sidecar.log_path`).
        parent: the training process's pid.
        policies: the Wrapper's :class:`RoundPolicies`, pickled (base64); None when they
            could not be pickled (lambdas): a notice that lays a round out then uses the
            defaults (:class:`ShiftRanks`, no filter, no retry limit).
        store_timeout ... heartbeat_timeout: the Wrapper's timeouts, in seconds.
    """

    rank: int
    world: int
    job: str
    call: int
    secret: str
    host: str
    port: int
    log_dir: str | None
    parent: int
    policies: str | None
    store_timeout: float
    barrier_timeout: float
    hard_timeout: float
    termination_grace_time: float
    heartbeat_interval: float
    heartbeat_timeout: float

    @classmethod
    def build(
        cls,
        cfg: WrapperConfig,
        *,
        rank: int,
        world: int,
        keys: Keyspace,
        addr: tuple[str, int],
        log_dir: str | os.PathLike[str] | None,
    ) -> SidecarConfig:
        """The configuration of this process's sidecar."""
        try:
            policies: str | None = base64.b64encode(pickle.dumps(cfg.policies)).decode()
        except Exception:  # lambdas: a sidecar that has to lay a round out uses ShiftRanks
            policies = None
        return cls(
            rank=rank,
            world=world,
            job=keys.job,
            call=keys.call,
            secret=keys.secret,
            host=addr[0],
            port=addr[1],
            log_dir=str(log_dir) if log_dir is not None else None,
            parent=os.getpid(),
            policies=policies,
            store_timeout=cfg.store_timeout,
            barrier_timeout=cfg.barrier_timeout,
            hard_timeout=cfg.hard_timeout,
            termination_grace_time=cfg.termination_grace_time,
            heartbeat_interval=cfg.heartbeat_interval,
            heartbeat_timeout=cfg.heartbeat_timeout,
        )

    def __repr__(self) -> str:  # never the secret nor the pickle: configurations get logged
        return f"SidecarConfig(rank={self.rank}, job={self.job!r}, call={self.call})"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SidecarConfig:
        """Inverse of :meth:`to_json`; a missing field raises ``KeyError`` naming it."""
        fields: dict[str, Any] = {
            f.name: _CONVERT[str(f.type)](value[f.name]) for f in dataclasses.fields(cls)
        }
        return cls(**fields)

    @property
    def keys(self) -> Keyspace:
        return Keyspace(self.job, self.call, self.secret)

    def round_policies(self) -> RoundPolicies:
        """The Wrapper's policies (the defaults when they could not be sent)."""
        if self.policies is None:
            return RoundPolicies()
        policies: RoundPolicies = pickle.loads(base64.b64decode(self.policies))
        return policies


def handshake_reply(line: bytes) -> dict[str, Any]:
    """A handshake line (the sidecar's or the agent's), parsed: ``{"ok": True, ...}`` or
    ``{"ok": False, "error": ...}``, also for a missing or unreadable line."""
    try:
        reply = json.loads(line) if line else {"ok": False, "error": "no handshake"}
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return {"ok": False, "error": f"unreadable handshake {line!r}"}
    return reply
