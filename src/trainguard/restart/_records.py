"""The barrier's values read back from the store, their types and shapes checked.

Anyone who can write to the store could leave any bytes under a key, and a rank must never
act on a value it misread: :func:`layout` returns a published round layout or raises
:class:`~trainguard.errors.CoordinationError` saying what is wrong with it, :func:`record`
returns a rank's barrier record or None for one that is unreadable.

A layout's rank lists (``active``, ``spare``) travel as runs (:func:`runs`): a rank ``r`` or a
pair ``[a, b]`` for the ranks ``a..b`` in that order, so that the usual layout (ranks in order,
a few gone) costs bytes in the number of gaps, not in the number of ranks: every rank reads the
whole layout each round, and at thousands of ranks a list of every rank would be most of the
store's traffic. :func:`layout` returns them as :class:`Ranks`: sequences read from the runs
without expanding them, so that reading a layout costs a rank O(runs), not O(ranks) (a rank
looks up its own place, the round's size, a few members; only code that walks every rank, as
the layout writer does, pays for every rank).
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError, CoordinationError

__all__ = ["Ranks", "layout", "record", "records", "runs"]

_MAX_RANKS = 1 << 22  # a run list that expands to more ranks than this is not a layout


def _load(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
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
    return isinstance(value, dict) and all(
        k.isdigit() and isinstance(v, str) for k, v in value.items()
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


def layout(raw: bytes | str) -> dict[str, Any]:
    """A round layout as :class:`~trainguard.restart._book.RoundBook` publishes it."""
    doc = _load(raw)
    if isinstance(doc, dict):
        # every rank reads the layout each round: its rank lists are parsed once into runs
        # (the check is the parsing itself), never expanded here
        expanded = {name: Ranks.parse(doc.get(name)) for name in _RANK_LISTS}
        bad = [name for name, ok in _LAYOUT.items() if not ok(doc.get(name))]
        bad[:0] = [name for name, ranks in expanded.items() if ranks is None]
        if not bad:
            doc.update(expanded)
            return doc
        problem = "bad " + ", ".join(bad)
    else:
        problem = "not a JSON object"
    text = raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")
    raise CoordinationError(
        f"unreadable round layout in the store ({problem}): {text[:200]!r}; something other "
        "than this job wrote it: give each job its own store (MASTER_PORT) and set "
        "TRAINGUARD_JOB_SECRET"
    )


def record(raw: bytes | str) -> dict[str, Any] | None:
    """A rank's barrier record (see :meth:`RoundBook.record`); None when it is not one."""
    return _checked(_load(raw))


def records(raws: Sequence[bytes]) -> list[dict[str, Any] | None]:
    """Many records (the last arriver reads every rank's), as :func:`record` reads each: one
    JSON parse for all of them (a parse per record was most of the last arriver's work at
    thousands of ranks), one each when that fails (a record that is not JSON)."""
    try:
        docs = json.loads(b"[" + b",".join(raws) + b"]")
    except (ValueError, UnicodeDecodeError):
        docs = None
    if not isinstance(docs, list) or len(docs) != len(raws):  # a value that was two
        return [record(raw) for raw in raws]
    return [_checked(doc) for doc in docs]


def _checked(doc: object) -> dict[str, Any] | None:
    if (
        isinstance(doc, dict)
        and _is_rank(doc.get("r"))
        and isinstance(doc.get("host"), str)
        and _is_int(doc.get("local_rank"))
        and _optional_str(doc.get("leave"))
        and _optional_str(doc.get("fault"))
    ):
        return doc
    return None
