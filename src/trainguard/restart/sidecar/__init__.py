"""The helper processes beside the training processes, which outlive them.

Internal to trainguard: this package exports nothing public (``__all__`` is empty). The names
below are what :mod:`trainguard.restart` and :mod:`trainguard.launch` import from it (its face:
no other package imports its private modules); they may change in any release.

A training process that crashes, hangs holding the GIL or loses its node cannot report it.
So each wrapped call is watched by a helper: it writes the death notice when the training
process dies (:mod:`._notice`), enforces the hard timeout (:mod:`._watch`), arrives at the
barriers for its ranks (:mod:`._arrival`), reads each round's outcome and layout once for them
(:mod:`._relay`), and beats once for its node in the node ring
(:mod:`trainguard.coord.node_ring`). Two helpers do it, one per node:

- the node watcher (:mod:`._node`): one process per host and wrapped call, shared by its ranks
  (``python -m trainguard.restart.sidecar``, :mod:`.__main__`, a fresh interpreter that never
  imports torch), started by the host's first rank;
- under ``trainguard launch``, the launcher's agent, which watches its workers itself
  (:class:`SidecarService`, :mod:`.agent_service`).

The rank's side of either is :class:`trainguard.restart._helper.HelperHandle`.

- :class:`SidecarConfig`: what a rank tells the helper that watches it, as one JSON line: on
  the stdin of the node watcher it starts, or over the helper's Unix socket; never on a
  command line, which every local user can read.
- :class:`SidecarService`: the agent's side: it watches the agent's workers.
"""

from __future__ import annotations

from trainguard.restart.sidecar._config import SidecarConfig as SidecarConfig
from trainguard.restart.sidecar.agent_service import SidecarService as SidecarService

__all__: list[str] = []
