"""What a node's helper keeps per wrapped call of its ranks: a relay and a node arrival.

The launcher's agent watches workers of any number of wrapped calls (a worker's second
``Wrapper`` call is another call, with its own keyspace); the node watcher serves one. For each
call the helper holds one
:class:`~trainguard.restart.sidecar._relay.Relay` (each round's outcome and layout read once for
its workers of that call) and one :class:`~trainguard.restart.sidecar._arrival.NodeArrival`
(one append and one add per round for them), both made with the first worker of the call that
connects, over pure-Python store connections (a wait on one can be interrupted when the
helper closes).

Protocol: :meth:`Calls.join` for each rank's watch, before its first line is fed; the
attributes of :class:`Calls` are guarded by its lock; :meth:`Calls.close` once, when the
helper stops (the arrivals' last batches go before the relays stop).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from trainguard.coord import _wire
from trainguard.restart.sidecar._arrival import NodeArrival
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._relay import Relay
from trainguard.restart.sidecar._watch import Watch

__all__ = ["Calls"]


class Calls:
    """The relays and node arrivals of the wrapped calls of one helper's ranks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._relays: dict[str, Relay] = {}  # a wrapped call's keyspace prefix -> its relay
        self._arrivals: dict[str, NodeArrival] = {}  # likewise -> its node arrival

    def join(self, cfg: SidecarConfig, watch: Watch, sock: Any) -> None:
        """Give ``watch`` (a worker of ``cfg``'s call, connected on ``sock``) to its call's
        relay and node arrival, made now if it is the call's first worker."""
        key = cfg.keys.prefix
        with self._lock:
            relay = self._relays.get(key)
            if relay is None:
                relay = self._relays[key] = Relay(cfg.keys, _connector(cfg))
            arrival = self._arrivals.get(key)
            if arrival is None:
                previous = functools.partial(relay.value, "ready")
                arrival = self._arrivals[key] = NodeArrival(_connector(cfg), previous)
        watch.on_relay = relay.hook(sock)
        arrival.watch(watch)

    @property
    def relay_reads(self) -> int:
        """Round keys the relays read from the store so far, for all calls (tests)."""
        with self._lock:
            return sum(relay.reads for relay in self._relays.values())

    def close(self) -> None:
        """Flush and stop the arrivals, then stop the relays; forget every call."""
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
            arrivals, self._arrivals = list(self._arrivals.values()), {}
        for arrival in arrivals:  # their last batches go before the relays stop
            arrival.close()
        for relay in relays:
            relay.close()


def _connector(cfg: SidecarConfig) -> Callable[[], Any]:
    """Makes a pure-Python store connection to ``cfg``'s store."""
    return lambda: _wire.connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
