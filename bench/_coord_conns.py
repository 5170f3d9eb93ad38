"""The store connections a real rank holds, counted (the rank function of bench/coord_scale.py).

Each rank runs a wrapped function on the library's real path (sidecar, monitor, watchdog,
next round's client made ahead, ``init_process_group("gloo")`` through the round's store) and,
once every rank is in the function, counts the established TCP connections from its own
process and from the helper process (the node watcher that every rank of this host shares) to any port the store process listens on (the coordination store and the
round stores). A helper's connections are shared by the ranks it watches: each rank counts the
helpers' connections divided by the ranks on this host.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from bench._soak_inject import SIDECAR_MODULE, cmdline
from trainguard.coord import _sockets


def _inodes(pid: int) -> set[int]:
    out = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def _store_ports(coord_port: int) -> set[int]:
    """The ports the store process listening on ``coord_port`` listens on."""
    listening = {
        s.inode: s.local_port for s in _sockets.tcp_sockets() if s.state == _sockets.LISTEN
    }
    for name in os.listdir("/proc"):
        if not name.isdigit() or "trainguard.coord._server" not in cmdline(int(name)):
            continue
        ports = {listening[i] for i in _inodes(int(name)) if i in listening}
        if coord_port in ports:
            return ports
    return {coord_port}


def _held(pid: int, ports: set[int]) -> int:
    socks = _sockets.tcp_sockets(_inodes(pid))
    return sum(1 for s in socks if s.state == _sockets.ESTABLISHED and s.remote_port in ports)


_LOOKS, _LOOK_S = 5, 0.1  # looks at the helpers' connections, and the time between them


def _helpers(ports: set[int]) -> int:
    """The connections to ``ports`` of every node watcher of this machine (only this job's hold
    connections to its store process's ports)."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and SIDECAR_MODULE in cmdline(int(name)):
            total += _held(int(name), ports)
    return total


def count_connections(settle_s: float) -> dict[str, Any]:
    """Run on each rank: its store connections and its sidecar's, inside the function."""
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr

    coord_port = int(os.environ["MASTER_PORT"])

    @tr.Wrapper(barrier_timeout=120, completion_timeout=120)
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        dist.init_process_group("gloo")
        t = torch.ones(4)
        dist.all_reduce(t)
        time.sleep(settle_s)  # the next round's client is made ahead meanwhile
        dist.barrier()
        ports = _store_ports(coord_port)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        # the steady count: the fewest of a few looks (a connection opened for a moment, a
        # relay's second wait or a beat's reconnect under load, is not what a node holds)
        helpers = _helpers(ports)
        for _ in range(_LOOKS - 1):
            time.sleep(_LOOK_S)
            helpers = min(helpers, _helpers(ports))
        out = {
            "process": _held(os.getpid(), ports),
            "helpers": helpers,  # every helper process of this host, all its ranks
            "sidecar": helpers / local,
            "store_ports": len(ports),
        }
        dist.barrier()
        dist.destroy_process_group()
        return out

    result: dict[str, Any] = train()
    return result
