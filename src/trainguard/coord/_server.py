"""The store process: hosts the coordination store and one store per restart round.

Started by the initial rank 0 with ``python -m trainguard.coord._server`` (a fresh interpreter
that does not import the user's ``__main__``; its configuration, job secret included, is the
first line on its stdin), so that a crash of any training process, rank 0 included, leaves the
store up. Every store it hosts listens on one interface only (:mod:`._bind`). Protocol:

1. Hosts the coordination TCPStore on the given port (unless it connects to an existing one).
2. Hosts round stores for rounds 0 and 1 on free ports and publishes their ``host:port`` under
   :meth:`Keyspace.pg_addr`; prints one JSON handshake line on stdout.
3. Whenever round ``n`` starts (its ``ready`` key is set) it closes round ``n-1``'s store (every
   rank of the job has left round ``n-1`` by then, so no old key stays visible) and opens round
   ``n+2``'s. So while round ``n`` runs, round ``n+1``'s store is up and its address published:
   the next round never waits for a store to start, and each rank connects to it ahead of time
   (:mod:`trainguard.restart._preconnect`), off the restart's critical path.
A **standby** store process (``standby`` in its configuration; started on a second host by the
rank with local rank 0 of node 1, when the coordination store is not this job's own) does steps
2 and 3 under :meth:`Keyspace.pg_standby`: the writer of a round's layout takes its store when
the first host's does not answer (that host is lost or cut off), so the job goes on without it.

4. Exits when the ``exit`` key is set (the last rank left), after deleting the job's keys from
   an external store. Once its parent (rank 0) is gone it serves the others on, and exits
   when its owner is gone too (the process that started rank 0: the launcher's agent,
   torchrun, the batch system's step, a shell; watched through a pidfd), whatever connections
   are left (anyone who reaches a port can hold one open), or when no client has been
   connected to any of its stores for ``orphan_grace`` seconds (nothing is left to serve).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from trainguard import _procfs, _subproc, _torchcompat
from trainguard.coord import _bind, _sockets, _wire
from trainguard.coord.barrier import read_set, timed_out, wait_forever
from trainguard.coord.keys import Keyspace

logger = logging.getLogger(__name__)

_CATCH_UP = timedelta(seconds=0.2)  # how often a follower waiting for a round looks further


class _Host:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.cfg = cfg
        self.keys = Keyspace(cfg["job"], cfg["call"], cfg["secret"])
        self.timeout = timedelta(seconds=cfg["timeout"])
        self.advertise = cfg["advertise_host"]
        self.bind = cfg["bind_host"]
        self.lock = threading.Lock()
        self.rounds: dict[int, Any] = {}
        host, port = cfg["coord_host"], cfg["coord_port"]
        self.own = bool(cfg["host_coord"])
        self.pg_key = self.keys.pg_standby if cfg.get("standby") else self.keys.pg_addr
        if self.own:
            self.coord: Any = _torchcompat.host_store(
                host, _bind.listen(host, port), timeout=self.timeout
            )
        else:
            self.coord = dist.TCPStore(
                host, port, is_master=False, use_libuv=True, timeout=self.timeout
            )
        self.server_ports = {self.coord.port} if self.own else set()
        self.last_round = 0

    def open_round(self, n: int) -> None:
        with self.lock:
            if n in self.rounds:
                return
            fd = _bind.listen(self.bind, 0)
            store = _torchcompat.host_store(self.advertise, fd, timeout=self.timeout)
            self.rounds[n] = store
            self.server_ports.add(store.port)
        self.coord.set(self.pg_key(n), f"{self.advertise}:{store.port}")

    def close_round(self, n: int) -> None:
        with self.lock:
            store = self.rounds.pop(n, None)
            if store is not None:
                self.server_ports.discard(store.port)
        if store is not None:
            del store  # the server stops and drops every key of the round
            self.coord.delete_key(self.pg_key(n))

    def follow_rounds(self) -> None:
        # Our own client, not torch's: its waits time out every _CATCH_UP, and torch's client
        # logs two warnings for each (ten lines a second on stderr in a job without faults).
        watcher = _wire.connect(
            self.cfg["coord_host"], self.coord.port, timeout=self.timeout.total_seconds()
        )
        n = 0
        while True:
            n = self.published(watcher, n)
            self.last_round = n
            self.open_round(n + 1)  # open already, unless this follower fell behind
            self.open_round(n + 2)  # round n+1's is up since round n-1 started
            with self.lock:
                old = [r for r in self.rounds if r < n]
            for r in old:
                self.close_round(r)
            n += 1

    def published(self, watcher: Any, n: int) -> int:
        """Wait until round ``n`` is published; the newest published round from then on.

        Round ``n``'s ready key is deleted when round ``n+1`` is published, and with round
        stores opened two rounds ahead nothing makes that wait for this follower: in rounds
        that fault at once it can miss the key. So every :data:`_CATCH_UP` it looks at
        :attr:`Keyspace.latest`, where each publisher copies its round: a later round there
        stands for it. That look is two requests (a ``check``, a read), made 5 times a second
        for as long as a round runs (it used to be a ``check`` of each of the next 64 rounds'
        keys: 330 requests a second, about 1,000-2,600 in each restart round of 16,384
        simulated ranks, and 0.16 s of this process's CPU).

        A wait that returns does not prove the key set: torch 2.13's server wakes the waiters
        of a key on a ``compare_set`` of it while it is unset (see :func:`barrier.read_set`).
        Taken for round ``n`` starting, such a wake would close round ``n-1``'s store under ranks
        still using it; so the key is checked after every wait."""
        while True:
            try:
                watcher.wait([self.keys.ready(n)], _CATCH_UP)
                if watcher.check([self.keys.ready(n)]):
                    return n
            except Exception as exc:
                if not timed_out(exc):
                    raise
            later = self.latest(watcher)
            if later > n:
                return later

    def latest(self, watcher: Any) -> int:
        """The newest round published, from :attr:`Keyspace.latest` (-1: none yet, or a value
        there that is not a round layout: anyone who reaches the store may write one)."""
        key = self.keys.latest
        if not watcher.check([key]):  # read_set of an unset key would wake its waiters
            return -1
        raw = read_set(watcher, key)
        try:
            n = json.loads(raw)["round"] if raw is not None else -1
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
            return -1
        return n if isinstance(n, int) and not isinstance(n, bool) else -1

    def external_clients(self) -> int:
        """Connections to our servers from sockets that are not our own clients."""
        with self.lock:
            ports = set(self.server_ports)
        mine = _sockets.tcp_sockets(set(_sockets.socket_fds()))
        own_client_ports = {
            s.local_port for s in mine if s.remote_port in ports and s.state == _sockets.ESTABLISHED
        }
        return sum(
            1
            for s in mine
            if s.local_port in ports
            and s.state == _sockets.ESTABLISHED
            and s.remote_port not in own_client_ports
        )

    def watch_orphan(self, parent: int, owner: int, owned: int | None, grace: float) -> None:
        """Once ``parent`` is gone: exit when ``owner`` (its pidfd ``owned``, None when it
        was gone at the start) is gone too, or after ``grace`` s without clients."""
        idle_since: float | None = None
        while True:
            time.sleep(1.0)
            if os.getppid() == parent:
                continue
            if owned is None or select.select([owned], [], [], 0)[0]:
                logger.warning(
                    "store process: parent and owner (pid %d) gone; exiting whatever "
                    "connections are left",
                    owner,
                )
                break
            if self.external_clients():
                idle_since = None
                continue
            now = time.monotonic()
            idle_since = idle_since or now
            if now - idle_since >= grace:
                logger.warning("store process: parent gone and no clients for %.0f s", grace)
                break
        self.coord.set(self.keys.exit, b"orphan")

    def cleanup_external(self) -> None:
        n = self.last_round
        keys = [self.keys.left, self.keys.exit, self.keys.handover, self.keys.latest]
        keys.append(self.keys.preempt_stop)
        keys.extend(self.keys.left_mark(r) for r in range(self.cfg["world_size"]))
        keys.extend(self.keys.preempt_done(r) for r in range(self.cfg["world_size"]))
        for r in range(max(0, n - 1), n + 3):
            keys.extend(self.keys.round_keys(r))
            keys.append(self.pg_key(r))
        for key in keys:
            with contextlib.suppress(Exception):  # best effort: the store may be going too
                self.coord.delete_key(key)
        with contextlib.suppress(Exception):
            self.coord.set(self.keys.ended, b"1")


def _owner(parent: int, owner: int) -> int | None:
    """A pidfd of ``owner`` (readable once it exited), None when it is no longer the parent
    of ``parent`` (gone: its pid may be another process's by now). Called while ``parent``
    waits for the handshake, so ``parent`` is there to ask."""
    try:
        fd = os.pidfd_open(owner)
    except OSError:
        return None
    try:
        if _procfs.parent_of(parent) == owner:
            return fd
    except ValueError:
        pass
    os.close(fd)
    return None


def main() -> int:
    # a preemption signals every process of the job: the ranks still agree and commit their
    # last checkpoint through this store; it ends with its owner (watch_orphan)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        cfg, _ = _subproc.read_config()
        host = _Host(cfg)
        host.open_round(0)
        host.open_round(1)
        owned = _owner(cfg["parent"], cfg["owner"])
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ok": True, "port": host.coord.port, "pid": os.getpid()}), flush=True)
    threading.Thread(target=host.follow_rounds, name="tg-rounds", daemon=True).start()
    threading.Thread(
        target=host.watch_orphan,
        args=(cfg["parent"], cfg["owner"], owned, cfg["orphan_grace"]),
        name="tg-orphan",
        daemon=True,
    ).start()
    waiter: Any = _torchcompat.clone_store(host.coord)
    wait_forever(waiter, host.keys.exit)
    if not host.own:
        host.cleanup_external()
    sys.stdout.flush()
    # Threads blocked in store waits cannot be joined; the servers go down with the process.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
