"""The sidecar: a process beside the training processes that outlives them.

A training process that crashes, hangs holding the GIL or loses its node cannot report it.
So each rank's wrapped call is watched by a small process (``python -m
trainguard.restart.sidecar``, :mod:`.__main__`), a fresh interpreter that shares nothing with
it: it writes the death notice when the training process dies (:mod:`._notice`), enforces the
hard timeout, and beats this rank's heartbeat in the store (declaring silent ranks gone). By
default the ranks of one host share one such process, the node watcher (:mod:`._node`);
``TRAINGUARD_SIDECAR=process`` gives each rank a sidecar process of its own.

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
- :func:`start_helper`: the one of the three that watches this process, started.
"""

from __future__ import annotations

from trainguard import _env
from trainguard.restart.sidecar._agent import AgentSidecar, agent_address
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import Sidecar, log_path
from trainguard.restart.sidecar._nodeclient import NodeSidecar

__all__ = ["AgentSidecar", "NodeSidecar", "Sidecar", "SidecarConfig", "log_path", "start_helper"]


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
