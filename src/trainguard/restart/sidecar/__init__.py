"""The sidecar: a process beside the training processes that outlives them.

Internal to trainguard: this package exports nothing public (``__all__`` is empty). The names
below are what :mod:`trainguard.restart` and :mod:`trainguard.launch` import from it (its face:
no other package imports its private modules); they may change in any release.

A training process that crashes, hangs holding the GIL or loses its node cannot report it.
So each rank's wrapped call is watched by a small process (``python -m
trainguard.restart.sidecar``, :mod:`.__main__`), a fresh interpreter that shares nothing with
it: it writes the death notice when the training process dies (:mod:`._notice`), enforces the
hard timeout, and beats this rank's heartbeat in the store (declaring silent ranks gone). By
default the ranks of one host share one such process, the node watcher (:mod:`._node`);
``TRAINGUARD_SIDECAR=process`` gives each rank a sidecar process of its own; under
``trainguard launch`` the agent watches its workers itself (:mod:`.agent_service`).

- :class:`Sidecar`: the training process's handle of its own sidecar process
  (``TRAINGUARD_SIDECAR=process``: start, handshake, lines, stop).
- :class:`AgentSidecar`: the same handle when ``trainguard launch``'s agent watches this
  process instead (``TRAINGUARD_AGENT``, :mod:`._agent`; no sidecar process).
- :class:`NodeSidecar`: the same handle when this node's ranks share one watcher process
  (the default, ``TRAINGUARD_SIDECAR=node``, :mod:`._node`).
- :class:`SidecarConfig`: what a rank tells the helper that watches it, as one JSON line:
  on the stdin of a sidecar process it starts (the node watcher's included), or over the
  node watcher's or the agent's Unix socket; never on a command line, which every local user
  can read.
- :class:`SidecarService`: the agent's side of :class:`AgentSidecar`: it watches the agent's
  workers (:mod:`.agent_service`).
- :func:`start_helper`: the one of the three handles that watches this process, started.
- :func:`start_for`: the same for one wrapped call, its configuration built.
"""

from __future__ import annotations

import os

from trainguard import _env
from trainguard.coord.keys import Keyspace
from trainguard.restart.config import WrapperConfig
from trainguard.restart.sidecar._agent import AgentSidecar as AgentSidecar
from trainguard.restart.sidecar._agent import NodeSidecar as NodeSidecar
from trainguard.restart.sidecar._agent import agent_address
from trainguard.restart.sidecar._config import SidecarConfig as SidecarConfig
from trainguard.restart.sidecar._handle import Sidecar as Sidecar
from trainguard.restart.sidecar._handle import log_path as log_path
from trainguard.restart.sidecar.agent_service import SidecarService as SidecarService

__all__: list[str] = []


def start_for(
    cfg: WrapperConfig,
    keys: Keyspace,
    addr: tuple[str, int],
    *,
    rank: int,
    world: int,
    log_dir: str | os.PathLike[str] | None,
) -> Sidecar | AgentSidecar:
    """The helper that watches initial rank ``rank``'s wrapped call (``cfg``; its keyspace
    ``keys`` in the coordination store at ``addr``), started: its configuration
    (:meth:`SidecarConfig.build`), then :func:`start_helper`. The handshake is the caller's
    (who holds the handle, to stop it, should the handshake fail)."""
    config = SidecarConfig.build(cfg, rank=rank, world=world, keys=keys, addr=addr, log_dir=log_dir)
    return start_helper(config)


def start_helper(config: SidecarConfig) -> Sidecar | AgentSidecar:
    """Start the helper that watches this process (its handshake is the caller's): under
    ``trainguard launch`` the agent's sidecar service (``TRAINGUARD_AGENT``), else this
    node's watcher (``TRAINGUARD_SIDECAR=node``, the default) or a sidecar process of its own."""
    agent = agent_address()
    if agent is not None:
        return AgentSidecar(config, agent).start()
    if _env.settings().sidecar == "node":
        return NodeSidecar(config).start()
    return Sidecar(config).start()
