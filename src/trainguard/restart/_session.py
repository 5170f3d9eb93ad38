"""One wrapped call's coordination: store connections, the store process, barriers, leaving."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any

from trainguard import _env, events
from trainguard.coord import barrier
from trainguard.coord.keys import Keyspace, decode, encode
from trainguard.coord.store import StoreProcess, connect, parse_addr
from trainguard.errors import ConfigError, RestartError, RetryLimitError
from trainguard.restart._launch import Launch, is_local_address
from trainguard.restart.policy.layout import Layout
from trainguard.restart.state import RoundOutcome

logger = logging.getLogger(__name__)

_detached: list[StoreProcess] = []  # store processes left serving the job after rank 0 left


class Session:
    """Store side of one wrapped call on one rank (built and closed by the Wrapper)."""

    def __init__(self, launch: Launch, call: int, cfg: Any) -> None:
        self.launch = launch
        self.cfg = cfg
        self.keys = Keyspace(launch.job, call)
        self.irank = launch.rank
        self.world = launch.world_size
        self.host = socket.gethostname()
        self.coord: Any = None
        self.watch_store: Any = None
        self.server: StoreProcess | None = None
        self.roster: tuple[int, ...] = tuple(range(self.world))
        self.order: tuple[int, ...] = self.roster
        self.previous_roster: tuple[int, ...] = self.roster
        self.gone: dict[int, str] = {}
        self.left = False
        self.coord_addr: tuple[str, int] | None = None

    @classmethod
    def detached(
        cls, *, keys: Keyspace, world: int, coord: Any, cfg: Any, roster: tuple[int, ...]
    ) -> Session:
        """A session that only writes notices for others (used by the sidecar process)."""
        self = cls.__new__(cls)
        self.keys, self.world, self.coord, self.cfg = keys, world, coord, cfg
        self.irank, self.host, self.launch = -1, "", None  # type: ignore[assignment]
        self.roster = self.order = self.previous_roster = roster
        self.gone, self.left, self.server, self.watch_store = {}, False, None, None
        return self

    # setup --------------------------------------------------------------------------------
    def open(self) -> None:
        cfg, launch = self.cfg, self.launch
        given = cfg.store
        if given is None:
            addr = _env.settings().store_addr
            if addr is not None:
                given = f"{addr[0]}:{addr[1]}"
        if given is None and launch.agent_store:
            given = f"{launch.master_addr}:{launch.master_port}"
        if isinstance(given, str):
            host, port = parse_addr(given)
            own = False
        elif given is not None:  # a TCPStore object
            host, port, own = given.host, given.port, False
        else:
            host, port, own = launch.master_addr, launch.master_port, True
        self.coord_addr = (host, port)
        if self.irank == 0:
            # The round stores live on this machine; ranks reach it by MASTER_ADDR when that
            # names it (always so when we host the coordination store there), else by name.
            local = own or is_local_address(launch.master_addr)
            advertise = launch.master_addr if local else self.host
            self.server = StoreProcess(
                job=self.keys.job,
                call=self.keys.call,
                coord_host=host,
                coord_port=port,
                host_coord=own,
                advertise_host=advertise,
                world_size=self.world,
                timeout=cfg.store_timeout,
            ).start()
        if given is not None and not isinstance(given, str):
            self.coord = given.clone()
        else:
            self.coord = connect(host, port, timeout=cfg.store_timeout)
        self.watch_store = self.coord.clone()

    # barrier ------------------------------------------------------------------------------
    # A rank arrives in two steps: its record (compare_set, so that a death notice cannot be
    # overwritten) and then one ``add`` to the round's counter. A rank may die between the two,
    # or right after them, before it laid the round out. So the count only says when to look:
    # whoever counts at least as many arrivals as the roster holds checks that every record is
    # in, lays the round out from the records and publishes it with compare_set (the first
    # layout wins; later ones read it). The last add always sees every record, so the round is
    # published exactly once however many extra adds death notices made (:meth:`take_arrival`).
    def barrier(self, n: int, *, leaving: str | None, fault: str | None) -> dict[str, Any] | None:
        """Round ``n``'s barrier; returns the published round (None for a leaving rank)."""
        record = {
            "r": self.irank,
            "host": self.host,
            "local_rank": self.launch.local_rank,
            "leave": leaving,
            "fault": fault,
        }
        value = encode(record)
        current = bytes(self.coord.compare_set(self.keys.member(n, self.irank), "", value))
        if current != value:  # another process declared this rank gone meanwhile
            self._declared_gone(n, decode(current).get("leave"))
        start = time.monotonic()
        raw = self._arrive(n)
        last = raw is not None
        if leaving is not None:
            return None
        if raw is None:
            raw = barrier.wait_key(
                self.coord, self.keys.ready(n), self.cfg.barrier_timeout, what=f"round {n} barrier"
            )
        waited = time.monotonic() - start
        ready = decode(raw)
        if str(self.irank) in ready["gone"]:  # declared gone after it arrived
            self._declared_gone(n, ready["gone"][str(self.irank)])
        events.emit("barrier", duration=waited, round_=n, last=last)
        self.previous_roster = self.roster
        self.roster = tuple(ready["active"]) + tuple(ready["spare"])
        self.order = self.roster
        self.gone = {int(k): v for k, v in ready["gone"].items()}
        return ready

    def _declared_gone(self, n: int, why: str | None) -> None:
        self.left = True  # whoever declared it gone counted it out of the job
        raise RestartError(
            f"rank {self.irank} was declared gone at round {n}'s barrier "
            f"({why or 'declared gone'}); it cannot rejoin: raise heartbeat_timeout if it was "
            "only slow"
        )

    def _arrive(self, n: int) -> bytes | None:
        """Count one arrival; if every record is in, publish the round. Returns the published
        round when this call found or made it, else None (wait for it)."""
        if int(self.coord.add(self.keys.arrive(n), 1)) < len(self.roster):
            return None
        if not self.coord.check([self.keys.member(n, r) for r in self.roster]):
            return None  # a rank wrote no record yet: its own add comes later
        payload = self._lay_out(n)
        published = bytes(self.coord.compare_set(self.keys.ready(n), "", payload))
        if published == payload:
            self._delete_round(n - 1)  # after publishing: off the others' critical path
        return published

    def _lay_out(self, n: int) -> bytes:
        """Run by the last arriver: read every record, apply the policies, publish."""
        cfg = self.cfg
        raws = self.coord.multi_get([self.keys.member(n, r) for r in self.roster])
        records = [decode(raw) for raw in raws]
        gone = dict(self.gone)
        present: set[int] = set()
        faults: dict[int, str] = {}
        info: dict[int, dict[str, str]] = {}
        for rec in records:
            r = int(rec["r"])
            if rec.get("fault"):
                faults[r] = rec["fault"]
            if rec.get("leave"):
                gone[r] = rec["leave"]
            else:
                present.add(r)
                info[r] = {"host": str(rec["host"]), "local_rank": str(rec["local_rank"])}
        layout = Layout.start(
            round=n,
            initial_world_size=self.world,
            previous=self.order,
            present=present,
            info=info,
        )
        end = None
        try:
            layout = cfg.rank_assignment(layout)
            if cfg.rank_filter is not None:
                layout = cfg.rank_filter(layout)
            if cfg.retry is not None:
                cfg.retry(layout)
            if present and not layout.active:
                raise RetryLimitError(
                    f"round {n}: the rank filter left no active rank among {sorted(present)}"
                )
        except RetryLimitError as exc:
            end = str(exc)
        except Exception as exc:
            end = f"a rank assignment or filter policy raised {type(exc).__name__}: {exc}"
        pg = (
            barrier.wait_key(self.coord, self.keys.pg_addr(n), self.cfg.store_timeout)
            if present
            else b""
        )
        return encode(
            {
                "round": n,
                "active": list(layout.active) if end is None else [],
                "spare": list(layout.spares) if end is None else sorted(present),
                "gone": {str(k): v for k, v in gone.items()},
                "faults": {str(k): v for k, v in faults.items()},
                "pg": pg.decode(),
                "end": end,
            }
        )

    def _delete_round(self, n: int) -> None:
        """Delete round ``n``'s keys: every rank of it has reached round ``n+1``'s barrier."""
        if n < 0:
            return
        for key in self.keys.round_keys(n, self.previous_roster):
            with contextlib.suppress(Exception):
                self.coord.delete_key(key)

    def take_arrival(self, n: int, r: int, cause: str) -> bool:
        """Make rank ``r``'s arrival at round ``n``'s barrier a departure (``r`` is gone), in
        whichever state ``r`` left it: no record, its record without its count, or both (it
        may even have been the last arrival and died before publishing the round).

        Idempotent: an extra count is harmless (see :meth:`barrier`). Returns True when ``r``
        had arrived on its own: a round published before its record was turned into a
        departure still holds ``r`` (the caller then follows ``r`` into that round)."""
        leave = encode({"r": r, "host": "", "local_rank": -1, "leave": cause, "fault": None})
        key = self.keys.member(n, r)
        current = bytes(self.coord.compare_set(key, "", leave))
        arrived = False
        while current != leave and not decode(current).get("leave"):
            arrived = True
            current = bytes(self.coord.compare_set(key, current, leave))
        self._arrive(n)
        return arrived

    def count_out(self, r: int) -> bool:
        """Count rank ``r`` as having left the job, once whoever calls it; True for the call
        that counted it. The last rank to leave lets the store process exit."""
        mark = encode({"by": self.irank, "pid": os.getpid(), "ns": time.monotonic_ns()})
        if bytes(self.coord.compare_set(self.keys.left_mark(r), "", mark)) != mark:
            return False
        if int(self.coord.add(self.keys.left, 1)) >= self.world:
            self.coord.set(self.keys.exit, b"done")
        return True

    # round outcome -------------------------------------------------------------------------
    def complete(self, n: int, active: int) -> None:
        """Count this rank's function as returned; the last one marks the round complete."""
        if int(self.coord.add(self.keys.done(n), 1)) == active:
            self.coord.compare_set(self.keys.stop(n), "", RoundOutcome.complete().encode())

    def stop(self, n: int, outcome: RoundOutcome) -> bool:
        """Propose ``outcome`` for round ``n``; True if it was the first (it wins)."""
        value = outcome.encode()
        return bytes(self.coord.compare_set(self.keys.stop(n), "", value)) == value

    # leaving -------------------------------------------------------------------------------
    def leave(self) -> None:
        """This rank leaves the job; the last to leave lets the store process exit."""
        if self.left or self.coord is None:
            return
        self.left = True
        try:
            self.count_out(self.irank)
        except Exception as exc:
            logger.warning("could not record this rank's exit in the store: %s", exc)

    def close(self, *, early: bool, timeout: float) -> None:
        """Drop the store clients; on rank 0 wait for the store process to exit.

        ``early``: this rank left while the others go on; its store process keeps serving
        them and exits on its own when the job ends (it is not waited for, so it outlives
        this call). Otherwise it is waited for up to ``timeout`` seconds, then killed.
        """
        self.watch_store = None
        self.coord = None
        if self.server is not None:
            if not early:
                self.server.close(timeout=timeout)
            elif not self.server.join(0.0):
                _detached.append(self.server)
            self.server = None


def check_store_arg(store: Any) -> None:
    if store is None or isinstance(store, str):
        if isinstance(store, str):
            try:
                parse_addr(store)
            except Exception as exc:
                raise ConfigError(f"store={store!r} is not 'host:port'") from exc
        return
    if not all(hasattr(store, a) for a in ("host", "port", "clone")):
        raise ConfigError(
            f"store={store!r}: pass a torch.distributed.TCPStore or 'host:port' (the store "
            "process must be able to connect to it too)"
        )
