"""The barrier's values read back from the store, their types and shapes checked.

Anyone who can write to the store could leave any bytes under a key, and a rank must never
act on a value it misread: :func:`layout` returns a published round layout
(:class:`RoundLayout`) or raises :class:`~trainguard.errors.CoordinationError` saying what is
wrong with it, :func:`record` returns a rank's barrier record (:class:`BarrierRecord`) or None
for one that is unreadable. Neither crashes on any bytes. Each record type's ``encode`` writes
the JSON that these read (the node watcher reads it too, without torch).

A layout's rank lists (``active``, ``spare``) travel as runs (:func:`runs`): a rank ``r`` or a
pair ``[a, b]`` for the ranks ``a..b`` in that order, so that the usual layout (ranks in order,
a few gone) costs bytes in the number of gaps, not in the number of ranks: every rank reads the
whole layout each round, and at thousands of ranks a list of every rank would be most of the
store's traffic. :func:`layout` returns them as :class:`Ranks`: sequences read from the runs
without expanding them, so that reading a layout costs a rank O(runs), not O(ranks) (a rank
looks up its own place, the round's size, a few members; only code that walks every rank, as
the layout writer does, pays for every rank).

Over 400 lines: the two record types and their readers stay together, so that each field's
encoding and its check on reading are side by side.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

from trainguard.coord.keys import encode
from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError, CoordinationError
from trainguard.restart._repeat import Repeats

__all__ = ["BarrierRecord", "Ranks", "RoundLayout", "layout", "record", "records", "runs"]

_MAX_RANKS = 1 << 22  # a run list that expands to more ranks than this is not a layout


def _load(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def runs(ranks: list[int] | tuple[int, ...]) -> list[int | list[int]]:
    """``ranks`` as runs: each maximal ascending step-1 stretch of 3 or more ranks becomes
    ``[first, last]``, the other ranks stay as they are (inverse: :meth:`Ranks.parse`)."""
    out: list[int | list[int]] = []
    i, n = 0, len(ranks)
    while i < n:
        j = i
        while j + 1 < n and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([ranks[i], ranks[j]])
        else:
            out.extend(ranks[i : j + 1])
        i = j + 1
    return out


class Ranks(Sequence[int]):
    """Initial ranks in a given order, kept as runs ``(first, last)`` of consecutive ranks.

    A read-only sequence: ``len``, indexing, ``index``, ``in`` cost O(log runs) or O(runs);
    iterating or comparing costs O(ranks), done only by code that needs every rank. Equal to
    any sequence of the same ranks in the same order (a list, a tuple, other ``Ranks``).
    """

    __slots__ = ("_firsts", "_lasts", "_len", "_starts")

    def __init__(self, pairs: Sequence[tuple[int, int]] = ()) -> None:
        firsts: list[int] = []
        lasts: list[int] = []
        for a, b in pairs:  # adjacent runs merged: equal sequences have equal runs
            if lasts and a == lasts[-1] + 1:
                lasts[-1] = b
            else:
                firsts.append(a)
                lasts.append(b)
        self._firsts, self._lasts = firsts, lasts
        self._starts = [
            0,
            *itertools.accumulate(b - a + 1 for a, b in zip(firsts, lasts, strict=True)),
        ]
        self._len = self._starts.pop()

    @classmethod
    def parse(cls, value: object) -> Ranks | None:
        """A run list (see :func:`runs`) as the ranks it stands for; None when it is not one."""
        if not isinstance(value, list):
            return None
        pairs: list[tuple[int, int]] = []
        total = 0
        for item in value:
            if _is_rank(item):
                pair = (item, item)
            elif (
                isinstance(item, list)
                and len(item) == 2
                and _is_rank(item[0])
                and _is_rank(item[1])
                and item[0] <= item[1]
            ):
                pair = (item[0], item[1])
            else:
                return None
            total += pair[1] - pair[0] + 1
            if total > _MAX_RANKS:
                return None
            pairs.append(pair)
        return cls(pairs)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("Ranks index out of range")
        run = bisect.bisect_right(self._starts, i) - 1
        return self._firsts[run] + i - self._starts[run]

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._firsts, self._lasts, strict=True):
            yield from range(a, b + 1)

    def __contains__(self, r: object) -> bool:
        if not isinstance(r, int):
            return False
        return any(a <= r <= b for a, b in zip(self._firsts, self._lasts, strict=True))

    def index(self, r: Any, start: int = 0, stop: int | None = None) -> int:
        for run, (a, b) in enumerate(zip(self._firsts, self._lasts, strict=True)):
            if a <= r <= b:
                i: int = self._starts[run] + r - a
                if start <= i and (stop is None or i < stop):
                    return i
        raise ValueError(f"{r!r} is not in Ranks")

    def __add__(self, other: Sequence[int]) -> Ranks:
        if not isinstance(other, Ranks):
            other = Ranks([(r, r) for r in other])
        return Ranks(
            [
                *zip(self._firsts, self._lasts, strict=True),
                *zip(other._firsts, other._lasts, strict=True),
            ]
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranks):
            return self._firsts == other._firsts and self._lasts == other._lasts
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Ranks({runs(list(self)) if self._len <= 64 else f'<{self._len} ranks>'})"


def roster(active: Sequence[int], spare: Sequence[int]) -> Sequence[int]:
    """The ranks of a round, active then spares, without expanding run lists."""
    if isinstance(active, Ranks):
        return active + spare
    return tuple(active) + tuple(spare)


def _why_by_rank(value: object) -> bool:
    # ASCII digits only, and few: int() refuses "²" and numbers of thousands of digits
    return isinstance(value, dict) and all(
        k.isascii() and k.isdigit() and len(k) <= 9 and isinstance(v, str) for k, v in value.items()
    )


def _pg(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return value == "" or bool(parse_addr(value))
    except ConfigError:
        return False


def _optional_str(value: object) -> bool:
    return value is None or isinstance(value, str)


def _is_rank(value: object) -> bool:
    return _is_int(value) and isinstance(value, int) and value >= 0


_Check = Callable[[object], bool]
_RANK_LISTS = ("active", "spare")  # run lists (see :func:`runs`), checked by parsing them
_LAYOUT: dict[str, _Check] = {
    "round": _is_int,
    "gone": _why_by_rank,
    "faults": _why_by_rank,
    "pg": _pg,
    "end": _optional_str,
}


@dataclasses.dataclass(frozen=True)
class RoundLayout:
    """A published round, as :class:`~trainguard.restart._book.RoundBook` lays it out.

    Attributes:
        round: the round's number.
        active: the initial ranks that run the function, index = rank in the round.
        spare: the initial ranks that wait idle.
        gone: initial ranks that left the job -> why.
        faults: the faults that ended the round before, initial rank -> description.
        pg: the round store's ``host:port`` ("" when no rank is present).
        end: why the job ends at this round (a retry limit, a repeated fault), or None.
        repeats: the run of rounds that failed the same way (:mod:`._repeat`).
        health: the hosts' record with a quarantine (:mod:`._health`'s JSON), else None.
    """

    round: int
    active: Sequence[int]
    spare: Sequence[int]
    gone: Mapping[int, str] = dataclasses.field(default_factory=dict)
    faults: Mapping[int, str] = dataclasses.field(default_factory=dict)
    pg: str = ""
    end: str | None = None
    repeats: Repeats = dataclasses.field(default_factory=Repeats)
    health: Mapping[str, Any] | None = None

    @property
    def roster(self) -> Sequence[int]:
        """The round's ranks, active then spares (run lists not expanded)."""
        return roster(self.active, self.spare)

    def holds(self, r: int) -> bool:
        """Whether initial rank ``r`` is in the round (active or spare)."""
        return r in self.active or r in self.spare

    def encode(self) -> bytes:
        """The JSON that the store holds (rank lists as runs, :func:`runs`)."""
        doc: dict[str, Any] = {"health": self.health} if self.health is not None else {}
        return encode(
            {
                **doc,
                "round": self.round,
                "active": runs(list(self.active)),
                "spare": runs(list(self.spare)),
                "gone": {str(k): v for k, v in self.gone.items()},
                "faults": {str(k): v for k, v in self.faults.items()},
                "pg": self.pg,
                "end": self.end,
                "repeats": self.repeats.encode(),
            }
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> RoundLayout:
        """Inverse of :meth:`encode`; raises :class:`CoordinationError` (see :func:`layout`)."""
        return layout(raw)


@dataclasses.dataclass(frozen=True)
class BarrierRecord:
    """One rank's record at a round's barrier (:meth:`RoundBook.record`).

    Attributes:
        rank: the initial rank it is the record of.
        host: the rank's host name ("" in a departure written for it).
        local_rank: its local rank (-1 in a departure written for it).
        leave: why it leaves the job, or None when it stays.
        fault: its fault that ended the round before, if it was the first.
        progress: whether it made progress in the round before (None: not said).
        raised: the cause of its own exception in the round before, first or not
            (:func:`~trainguard.restart._attribution.cause_of`), for attribution.
        probe: its health probes' result while its host is quarantined ("ok" or the failure).
    """

    rank: int
    host: str
    local_rank: int
    leave: str | None = None
    fault: str | None = None
    progress: bool | None = None
    raised: str | None = None
    probe: str | None = None

    @property
    def departed(self) -> bool:
        """Whether this is a :meth:`departure` (a death notice's), not the rank's own record."""
        return self.leave is not None and self.local_rank < 0

    @classmethod
    def departure(cls, rank: int, cause: str) -> BarrierRecord:
        """The record that another process (a death notice) writes for a gone rank."""
        return cls(rank, "", -1, leave=cause)

    def encode(self) -> bytes:
        """The JSON that the store holds (``progress`` left out when not said)."""
        doc: dict[str, object] = {
            "r": self.rank,
            "host": self.host,
            "local_rank": self.local_rank,
            "leave": self.leave,
            "fault": self.fault,
        }
        if self.progress is not None:
            doc["progress"] = self.progress
        for name in ("raised", "probe"):  # left out when not set
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        return encode(doc)

    @classmethod
    def decode(cls, raw: bytes | str) -> BarrierRecord | None:
        """Inverse of :meth:`encode`; None when ``raw`` is not a record (see :func:`record`)."""
        return record(raw)


def layout(raw: bytes | str) -> RoundLayout:
    """A round layout as :class:`~trainguard.restart._book.RoundBook` publishes it."""
    doc = _load(raw)
    if isinstance(doc, dict):
        # every rank reads the layout each round: its rank lists are parsed once into runs
        # (the check is the parsing itself), never expanded here
        active, spare = (Ranks.parse(doc.get(name)) for name in _RANK_LISTS)
        bad = [name for name, ok in _LAYOUT.items() if not ok(doc.get(name))]
        ranks = zip(_RANK_LISTS, (active, spare), strict=True)
        bad[:0] = [name for name, parsed in ranks if parsed is None]
        if not bad and active is not None and spare is not None:
            return RoundLayout(
                round=doc["round"],
                active=active,
                spare=spare,
                gone={int(k): v for k, v in doc["gone"].items()},
                faults={int(k): v for k, v in doc["faults"].items()},
                pg=doc["pg"],
                end=doc.get("end"),
                repeats=Repeats.decode(doc.get("repeats")),
                health=health if isinstance(health := doc.get("health"), dict) else None,
            )
        problem = "bad " + ", ".join(bad)
    else:
        problem = "not a JSON object"
    text = raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")
    raise CoordinationError(
        f"unreadable round layout in the store ({problem}): {text[:200]!r}; something other "
        "than this job wrote it: give each job its own store (MASTER_PORT) and set "
        "TRAINGUARD_JOB_SECRET"
    )


def record(raw: bytes | str) -> BarrierRecord | None:
    """A rank's barrier record (see :meth:`RoundBook.record`); None when it is not one."""
    return _checked(_load(raw))


def records(raws: Sequence[bytes]) -> list[BarrierRecord | None]:
    """Many records (the last arriver reads every rank's), as :func:`record` reads each: one
    JSON parse for all of them (a parse per record was most of the last arriver's work at
    thousands of ranks), one each when that fails (a record that is not JSON)."""
    try:
        docs = json.loads(b"[" + b",".join(raws) + b"]")
    except (ValueError, UnicodeDecodeError, RecursionError):
        docs = None
    if not isinstance(docs, list) or len(docs) != len(raws):  # a value that was two
        return [record(raw) for raw in raws]
    return [_checked(doc) for doc in docs]


def _checked(doc: object) -> BarrierRecord | None:
    """The record of one parsed JSON value, or None. The last arriver runs this once per rank
    (16,384 times a round at 16,384 ranks): each field is looked up once, and a JSON value's
    type is one of JSON's (``type(v) is int`` is :func:`_is_int`: a JSON bool is not an int)."""
    if type(doc) is not dict:
        return None
    get = doc.get
    r, host, local_rank = get("r"), get("host"), get("local_rank")
    leave, fault = get("leave"), get("fault")
    if not (
        type(r) is int
        and r >= 0
        and type(host) is str
        and type(local_rank) is int
        and (leave is None or type(leave) is str)
        and (fault is None or type(fault) is str)
    ):
        return None
    progress, raised, probe = get("progress"), get("raised"), get("probe")
    return BarrierRecord(
        r,
        host,
        local_rank,
        leave,
        fault,
        progress if type(progress) is bool else None,
        raised[:2000] if type(raised) is str else None,
        probe[:2000] if type(probe) is str else None,
    )
