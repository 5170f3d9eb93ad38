"""The round book: the records of the rounds' barriers in the store, and who left the job.

Two kinds of writers keep it, each with a :class:`RoundBook` of its own over its own store
connection: a rank's :class:`~trainguard.restart._session.Session` (it arrives at each barrier,
may lay the round out, counts itself out at the end), and a sidecar writing a death notice
(:mod:`trainguard.restart.sidecar._notice`: it turns a gone rank's arrival into a departure,
may lay the round out, counts that rank out).

The records of round ``n`` are lines ``append``-ed to one value, :meth:`Keyspace.pool`, so
that a node watcher arrives for all its ranks at once with one ``append`` and one ``add`` of
their number (:mod:`trainguard.restart.sidecar._arrival`); a rank without a watcher, a
newcomer and a death notice append their one line the same way. A rank may appear more than
once (its node's line, then its own after the node's watcher died; an arrival and a notice's
departure): a departure wins over any arrival, whatever their order, so that no arrival
overwrites a notice; among arrivals the first counts. A notice learns whether the rank had
arrived on its own (:meth:`RoundBook.take_arrival`) from the order of the lines: an arrival
before its departure.

A rank arrives in two steps: its record (a line of the pool) and then one ``add`` to the
round's counter. An ``append`` precedes its writer's ``add``, so the last ``add`` sees every
line, and the layout writer reads one key, not one per rank. A rank may die between the two, or
right after them, before it laid the round out. So the count only says when to look: whoever
counts at least as many arrivals as the roster holds checks that every record is in, lays the
round out from the records and publishes it with ``compare_set`` (the first layout wins; later
ones read it). The last ``add`` always sees every record, so the round is published exactly
once however many extra adds death notices made (:meth:`RoundBook.take_arrival`). The
publisher then copies the layout to :attr:`Keyspace.latest` (one more ``set``), where a
newcomer finds the running round (:mod:`._join`).

Newcomers: a rank that left the job (it is in ``gone``) may come back as a new process
(respawned by a launcher). It writes its record for the next round without counting itself
(it is not in the roster); the layout writer looks for such records of gone ranks only
(nothing to do while ``gone`` is empty) and admits those present and not leaving: each is
taken out of ``gone`` and its departure undone (its left mark deleted, ``left`` decremented
once, whoever deletes the mark), so that the store process does not exit while it still
serves. A layout writer whose layout lost the publication counts out again the ranks it
admitted that the published round does not hold.

A round's outcome (its stop key) is written here only: :func:`propose` (the first proposal
wins) and :meth:`RoundBook.complete` (the last active rank to return proposes ``complete``).
Every proposer (a rank's fault or hang, the monitor's close, a newcomer's admission, a death
notice, the straggler policy) goes through them.

Over 400 lines: one class and the pool readers that it and the death notices share, so that
the round's write protocol (record, count, lay out, publish, admit, count out) stays in one
place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.coord import barrier
from trainguard.coord.keys import Keyspace, encode
from trainguard.coord.store import StoreLike, parse_addr, probe
from trainguard.errors import ConfigError, CoordinationError, RetryLimitError
from trainguard.restart import _health, _pool, _records
from trainguard.restart._records import BarrierRecord, RoundLayout
from trainguard.restart._repeat import Repeats
from trainguard.restart.policy._round import RoundPolicies
from trainguard.restart.policy.layout import Layout
from trainguard.restart.state import RoundOutcome

logger = logging.getLogger(__name__)


def peek(store: StoreLike, key: str) -> bytes | None:
    """The value of ``key``, None when it is not set; never waits (unlike ``get``) and never
    sets it (``compare_set`` with an expected value that no value equals).

    ``check`` first: a ``compare_set`` of a key that is not set wakes every client waiting for
    that key although nothing was set (torch 2.13's TCPStore), and such a waiter then reads a
    value that is not there (a monitor waiting for its round's outcome read an empty one)."""
    if not store.check([key]):
        return None
    return barrier.read_set(store, key)


def propose(store: StoreLike, keys: Keyspace, n: int, outcome: RoundOutcome) -> bool:
    """Propose ``outcome`` for round ``n`` on ``store``: one ``compare_set`` of the round's
    stop key from unset. True when this proposal won (it is the round's outcome); False when
    another outcome was there first (that one holds)."""
    value = outcome.encode()
    return bytes(store.compare_set(keys.stop(n), "", value)) == value


@dataclasses.dataclass(eq=False)
class RoundBook:
    """One writer's view of the barrier records of one wrapped call.

    Attributes:
        store: this writer's store connection.
        keys: the call's keyspace.
        world: the initial world size.
        policies: how the round is laid out when this writer publishes it.
        store_timeout: the longest the layout waits for the round's store address.
        roster: the ranks expected at the next barrier (active then spares); all at first.
        writer: the initial rank of the writer, -1 for a sidecar (recorded in the left marks).
        gone: initial ranks that left the job -> why, as of the last published round.
        repeats: the run of rounds that failed the same way, as of the last published round.
        health: the hosts' record (:mod:`._health`), as of the last published round.
    """

    store: StoreLike
    keys: Keyspace
    world: int
    policies: RoundPolicies
    store_timeout: float
    roster: Sequence[int] = ()
    writer: int = -1
    gone: dict[int, str] = dataclasses.field(init=False, default_factory=dict)
    repeats: Repeats = dataclasses.field(init=False, default_factory=Repeats)
    health: Mapping[str, Any] | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.roster = self.roster or _records.Ranks(((0, self.world - 1),))  # O(1), not O(N)

    def record(self, n: int, record: BarrierRecord) -> None:
        """Append ``record`` (a rank's) to round ``n``'s pool. A departure there first wins
        in the layout, which tells the rank (see the module docstring)."""
        self.store.append(self.keys.pool(n), record.encode() + b"\n")

    def pool(self, n: int, records: Sequence[bytes]) -> None:
        """Append ``records`` (encoded, each one line) to round ``n``'s pool at once (a node
        watcher's arrival for its ranks; their count follows, :meth:`arrive`)."""
        self.store.append(self.keys.pool(n), b"".join(rec + b"\n" for rec in records))

    def arrive(self, n: int, count: int = 1) -> bytes | None:
        """Count ``count`` arrivals (whose records are in); if every record is in, publish
        the round. Returns the published round when this call found or made it, else None
        (wait for it)."""
        if int(self.store.add(self.keys.arrive(n), count)) < len(self.roster):
            return None
        found = self._found(n)
        if found is None:
            return None  # a rank wrote no record yet: its own add comes later
        payload, admitted = self._lay_out(n, found)
        published = bytes(self.store.compare_set(self.keys.ready(n), "", payload))
        if published == payload:
            self.store.set(self.keys.latest, payload)
            self._delete_round(n - 1)  # after publishing: off the others' path
        elif admitted:
            self._recount(admitted, published)
        return published

    def propose(self, n: int, outcome: RoundOutcome) -> bool:
        """Propose ``outcome`` for round ``n`` (:func:`propose`); True when it won."""
        return propose(self.store, self.keys, n, outcome)

    def complete(self, n: int, active: int) -> bool:
        """Count one returned function of round ``n``, whose ``active`` ranks run it; the last
        one proposes ``complete`` (True when that proposal won)."""
        if int(self.store.add(self.keys.done(n), 1)) != active:
            return False
        return self.propose(n, RoundOutcome.complete())

    def enter(self, ready: RoundLayout) -> None:
        """Follow the published round ``ready``: its ranks are the next barrier's roster.
        (The publisher deletes the round before's keys, :meth:`_delete_round`.)"""
        self.roster = ready.roster
        self.gone = dict(ready.gone)
        self.repeats = ready.repeats
        self.health = ready.health

    def _found(self, n: int) -> dict[int, BarrierRecord | None] | None:
        """Round ``n``'s records: every line's of its pool, newcomers' included; None when
        a rank of the roster has none yet."""
        raw = peek(self.store, self.keys.pool(n))
        found = _pool.records_of(raw or b"")
        if any(r not in found for r in self.roster):
            return None
        return found

    def _lay_out(
        self, n: int, found: dict[int, BarrierRecord | None] | None = None
    ) -> tuple[bytes, list[int]]:
        """Run by the last arriver: from every record (``found``; read when not given),
        apply the policies; the layout to publish and the gone ranks it admits."""
        found = self._found(n) if found is None else found
        if found is None:
            raise CoordinationError(f"round {n}'s barrier records are not all in")
        gone = dict(self.gone)
        present: set[int] = set()
        faults: dict[int, str] = {}
        info: dict[int, dict[str, str]] = {}
        progress = False
        for r in self.roster:
            rec = found[r]
            if rec is None or rec.rank != r:  # not this job's: that rank cannot be counted on
                gone[r] = "its barrier record in the store is unreadable"
                continue
            progress = progress or rec.progress is True
            if rec.fault:
                faults[r] = rec.fault
            if rec.leave:
                gone[r] = rec.leave
            else:
                present.add(r)
                info[r] = {"host": rec.host, "local_rank": str(rec.local_rank)}
        admitted = self._admit(n, gone, present, info, found) if gone else []
        outcome = (
            RoundOutcome.decode(raw)
            if n > 0 and (raw := peek(self.store, self.keys.stop(n - 1)))
            else None
        )
        died = [r for r in gone if r not in self.gone and (rec := found.get(r)) and rec.departed]
        health, excluded = _health.judge_round(
            self.health,
            self.policies.quarantine,
            outcome,
            found,
            info,
            time.time(),
            died=self._last_seen(n - 1, died),
        )
        layout = Layout.start(
            round=n,
            initial_world_size=self.world,
            previous=self.roster,
            present=present,
            info=info,
        ).replace(excluded=excluded)
        end = None
        try:
            layout = self.policies.apply(layout)
        except RetryLimitError as exc:
            end = _health.ended(str(exc), health)
        except Exception as exc:
            end = f"a rank assignment or filter policy raised {type(exc).__name__}: {exc}"
        repeats = self.repeats.after(faults, progress)
        end = end or repeats.verdict(self.policies.max_repeated_faults)
        pg = self._round_store(n) if present else b""
        published = RoundLayout(
            round=n,
            active=layout.active if end is None else (),
            spare=layout.spares if end is None else sorted(present),
            gone=gone,
            faults=faults,
            pg=pg.decode(),
            end=end,
            repeats=repeats,
            health=health or None,
        )
        return published.encode(), admitted

    def _round_store(self, n: int) -> bytes:
        """The address of round ``n``'s store: the first store process's, unless it does not
        answer and the standby on a second host published one (that host is lost or cut off;
        one probe of at most a second, only then)."""
        first = peek(self.store, self.keys.pg_addr(n))
        if first is not None and _answers(first):
            return first
        standby = peek(self.store, self.keys.pg_standby(n))
        if standby is not None and _answers(standby):
            logger.warning(
                "round %d's store on the first host (%s) does not answer: the round uses the "
                "standby's (%s)",
                n,
                first.decode(errors="replace") if first else "not published",
                standby.decode(errors="replace"),
            )
            return standby
        return barrier.wait_key(self.store, self.keys.pg_addr(n), self.store_timeout)

    def _admit(
        self,
        n: int,
        gone: dict[int, str],
        present: set[int],
        info: dict[int, dict[str, str]],
        found: dict[int, BarrierRecord | None],
    ) -> list[int]:
        """Admit the gone ranks that came back: a record of round ``n`` that is not leaving
        (among ``found``). Moves each from ``gone`` to ``present`` and
        undoes its departure; returns them."""
        admitted = []
        for r in sorted(gone):
            if r in self.roster:
                continue
            rec = found.get(r)
            if rec is None or rec.rank != r or rec.leave:
                continue
            del gone[r]
            present.add(r)
            info[r] = {"host": rec.host, "local_rank": str(rec.local_rank)}
            if self.store.delete_key(self.keys.left_mark(r)):
                self.store.add(self.keys.left, -1)
            admitted.append(r)
        return admitted

    def _recount(self, admitted: list[int], published: bytes) -> None:
        """This writer admitted ``admitted`` but another layout was published: count out
        again those it does not hold."""
        holds = set(_records.layout(published).roster)
        for r in admitted:
            if r not in holds:
                self.count_out(r)

    def _last_seen(self, n: int, ranks: list[int]) -> dict[int, str]:
        """Ranks gone during round ``n`` -> the host of their record at round ``n``'s barrier
        ("" when not readable), for attribution. Read only when a rank died; round ``n``'s keys
        are deleted only after round ``n+1`` is published."""
        hosts = dict.fromkeys(ranks, "")
        if not ranks or n < 0:
            return hosts
        with contextlib.suppress(Exception):  # a record gone or unreadable: the host is unknown
            seen = _pool.records_of(peek(self.store, self.keys.pool(n)) or b"")
            for r in ranks:
                rec = seen.get(r)
                hosts[r] = rec.host if rec is not None and rec.rank == r else ""
        return hosts

    def _delete_round(self, n: int) -> None:
        """Delete round ``n``'s keys (its pool among them): every rank of it has reached round
        ``n+1``'s barrier, just published."""
        if n < 0:
            return
        for key in self.keys.round_keys(n):
            with contextlib.suppress(Exception):
                self.store.delete_key(key)

    def take_arrival(self, n: int, r: int, cause: str) -> bool:
        """Make rank ``r``'s arrival at round ``n``'s barrier a departure (``r`` is gone), in
        whichever state ``r`` left it: no record, its record without its count, or both (it
        may even have been the last arrival and died before publishing the round).

        Idempotent: an extra count is harmless (see the module docstring). Returns True when
        ``r`` had arrived on its own: a round published before its record was turned into a
        departure still holds ``r`` (the caller then follows ``r`` into that round)."""
        leave = BarrierRecord.departure(r, cause).encode()
        self.store.append(self.keys.pool(n), leave + b"\n")
        arrived = _pool.arrived_first(self.store.get(self.keys.pool(n)), r)
        self.arrive(n)
        return arrived

    def count_out(self, r: int) -> bool:
        """Count rank ``r`` as having left the job, once whoever calls it; True for the call
        that counted it. The last rank to leave lets the store process exit."""
        mark = encode({"by": self.writer, "pid": os.getpid(), "ns": time.monotonic_ns()})
        if bytes(self.store.compare_set(self.keys.left_mark(r), "", mark)) != mark:
            return False
        if int(self.store.add(self.keys.left, 1)) >= self.world:
            self.store.set(self.keys.exit, b"done")
        return True


def has_record(store: StoreLike, keys: Keyspace, n: int, r: int) -> bool:
    """Whether rank ``r`` has a record of round ``n`` (arrived, or a departure written)."""
    raw = peek(store, keys.pool(n))
    return raw is not None and r in _pool.records_of(raw)


def _answers(addr: bytes) -> bool:
    """Whether a server accepts connections at ``addr`` (``host:port``), within a second."""
    try:
        return probe(*parse_addr(addr.decode())) == "up"
    except (ValueError, ConfigError):
        return False
