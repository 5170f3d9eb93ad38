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
- :class:`SidecarConfig`: what the sidecar is told on its command line.
"""

from __future__ import annotations

from trainguard.restart.sidecar._agent import AgentSidecar
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import Sidecar, log_path
from trainguard.restart.sidecar._nodeclient import NodeSidecar

__all__ = ["AgentSidecar", "NodeSidecar", "Sidecar", "SidecarConfig", "log_path"]
