"""A round's pooled barrier records: one store key per round, a line per record.

Under node arrival the records of round ``n`` are not one key per rank but lines appended to
one key (:meth:`Keyspace.pool <trainguard.coord.keys.Keyspace.pool>`): a rank's arrival, and
a departure that a death notice appends for a gone rank. :mod:`._book` writes them (its
module docstring holds the protocol: an arrival before its departure); this module reads
them, as plain functions of the key's bytes.
"""

from __future__ import annotations

from trainguard.restart._records import BarrierRecord, records

__all__ = ["arrived_first", "leaving", "records_of"]


def _lines(raw: bytes) -> list[BarrierRecord | None]:
    return records([line for line in bytes(raw).split(b"\n") if line.strip()])


def records_of(raw: bytes) -> dict[int, BarrierRecord | None]:
    """The records of a pool: each rank's departure if it has one, else its first arrival.
    Lines that are not records are skipped (their rank, if any, counts as not arrived)."""
    found: dict[int, BarrierRecord | None] = {}
    for rec in _lines(raw):
        if rec is None:
            continue
        if rec.rank not in found or (rec.leave and not leaving(found[rec.rank])):
            found[rec.rank] = rec
    return found


def arrived_first(raw: bytes, r: int) -> bool:
    """Whether the pool ``raw`` holds an arrival of ``r`` before its first departure."""
    for rec in _lines(raw):
        if rec is not None and rec.rank == r:
            return not rec.leave
    return False


def leaving(rec: BarrierRecord | None) -> bool:
    """Whether ``rec`` is a departure (a gone rank's, or a rank that leaves the job)."""
    return rec is not None and bool(rec.leave)
