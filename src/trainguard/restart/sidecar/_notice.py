"""Death notices: what a sidecar writes to the store when a rank is gone.

A rank is gone when its training process died (its own sidecar saw the pidfd wake) or when
its heartbeats stopped (another rank's sidecar declared it silent). Either way the others
must learn it at once, wherever the rank was in the protocol:

- inside round ``n``: the round's outcome becomes a fault (the others abort), and the rank's
  arrival at round ``n+1``'s barrier is recorded as a departure, so that barrier completes as
  soon as the live ranks arrive;
- already at round ``n+1``'s barrier (it wrote its record, and maybe its count, and maybe it
  was the last arrival and died before publishing the round): its arrival is turned into a
  departure (:meth:`RoundBook.take_arrival`); if the round was published with the rank in it
  anyway, the notice follows it into that round and starts over.

The rank is then counted out of the job once, whoever writes the notice
(:meth:`RoundBook.count_out`).

A launcher that respawns the rank writes the notice with ``returning=True``. When round
``n`` (as published) has a live idle spare other than the rank, the spare takes its place at
once: the notice is an ordinary one (the respawned process later joins as a newcomer, see
:mod:`trainguard.restart._join`). Otherwise round ``n`` becomes a fault, but the rank is
neither counted out nor is its arrival at round ``n+1`` taken: that barrier waits for the
rank's new process, which arrives there like any rank. If it never comes, the launcher
writes the notice again with ``returning=False``: an ordinary departure, so the barrier
completes without it. A rank that had already arrived at round ``n+1`` gets an ordinary
notice (its new process then joins as a newcomer).

:func:`write_notice` writes one; :func:`notify` writes it for a watch (the node watcher's, a
sidecar's or the launcher's sidecar service) and logs it; :func:`notify_anew` writes a final one
on a connection of its own, where the rank was last seen or, when nobody here knows, at the
latest round the store published (:func:`latest_position`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from trainguard import events
from trainguard.coord.barrier import wait_key
from trainguard.coord.store import StoreLike, connect
from trainguard.restart import _records
from trainguard.restart._book import RoundBook, has_record, peek, propose
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.state import RoundOutcome

# the sidecar's own logger (the node watcher's and the agent's log files hold its lines)
logger = logging.getLogger("trainguard.restart.sidecar")


@dataclasses.dataclass(frozen=True)
class Notice:
    """What a death notice did (also emitted as the ``rank_gone`` event)."""

    gone_rank: int
    gone_round: int  # the last round the rank was in
    cause: str
    counted: bool  # this notice counted the rank out of the job (not an earlier one)
    duration: float  # seconds the notice took
    returning: bool = False  # the barrier of round gone_round + 1 waits for its new process


def write_notice(
    store: StoreLike,
    cfg: SidecarConfig,
    r: int,
    n: int,
    roster: Sequence[int],
    cause: str,
    *,
    returning: bool = False,
) -> Notice:
    """Rank ``r``, last seen in round ``n`` (-1: before the first barrier) whose ranks were
    ``roster``, is gone for ``cause``; ``store`` is this notice's own connection.
    ``returning``: a new process of ``r`` is on its way (see the module docstring)."""
    keys = cfg.keys
    start = time.monotonic()
    if returning and _awaits_return(store, cfg, r, n, cause):
        notice = Notice(r, n, cause, False, time.monotonic() - start, returning=True)
        _emit(notice)
        return notice
    policies = cfg.round_policies()
    while True:
        book = RoundBook(
            store,
            keys,
            cfg.world,
            policies,
            store_timeout=cfg.store_timeout,
            roster=roster,
        )
        follow(book, n)
        if n >= 0 and r in roster and not has_record(store, keys, n + 1, r):
            # Gone inside round n: a fault of that round, so the others abort it. (A
            # newcomer waiting outside the roster was in no round: nothing to abort.)
            book.propose(n, RoundOutcome.fault(r, cause, "RankGone"))
        if not book.take_arrival(n + 1, r, cause):
            break  # its departure is recorded before any record of its own: it is out
        # It had arrived at round n+1's barrier. The barrier completes now without waiting
        # for it, unless the round was laid out from its own record before the departure.
        raw = wait_key(store, keys.ready(n + 1), cfg.barrier_timeout, what="barrier")
        ready = _records.layout(raw)
        n += 1
        roster = ready.roster
        if r not in roster or ready.end:
            break
    counted = book.count_out(r)
    notice = Notice(r, n, cause, counted, time.monotonic() - start)
    _emit(notice)
    return notice


def follow(book: RoundBook, n: int) -> None:
    """Give ``book`` the job's history as of published round ``n``: the ranks gone before and
    the repeated faults. Should this notice complete round ``n+1``'s barrier, its layout
    carries them on, and admits a gone rank whose new process waits with its record."""
    raw = peek(book.store, book.keys.ready(n)) if n >= 0 else None
    if raw is not None:
        ready = _records.layout(raw)
        book.gone = dict(ready.gone)
        book.repeats = ready.repeats
        book.health = ready.health


def _awaits_return(store: StoreLike, cfg: SidecarConfig, r: int, n: int, cause: str) -> bool:
    """With no live idle spare in round ``n``, make round ``n`` a fault and leave ``r`` in
    the roster of round ``n+1`` (True). False: an ordinary notice is needed (there is a
    spare, ``r`` already arrived at ``n+1``, or round ``n`` is not readable)."""
    keys = cfg.keys
    if has_record(store, keys, n + 1, r):
        return False
    if n < 0:
        return True  # round 0's barrier waits for every rank anyway: nothing to abort
    raw = peek(store, keys.ready(n))
    if raw is None:
        return False
    ready = _records.layout(raw)
    if not ready.holds(r):
        return False
    spares = [s for s in ready.spare if s != r]
    if any(peek(store, keys.left_mark(s)) is None for s in spares) and not ready.end:
        return False  # a live idle spare takes r's place at once
    propose(store, keys, n, RoundOutcome.fault(r, cause, "RankGone"))
    return True


def _emit(notice: Notice) -> None:
    events.emit(
        "rank_gone",
        duration=notice.duration,
        gone_rank=notice.gone_rank,
        gone_round=notice.gone_round,
        cause=notice.cause,
        counted=notice.counted,
        returning=notice.returning,
    )


def notify(
    store: StoreLike,
    cfg: SidecarConfig,
    r: int,
    where: tuple[int, tuple[int, ...]],
    cause: str,
    *,
    returning: bool = False,
) -> Notice | None:
    """Write the death notice of rank ``r`` in the wrapped call of ``cfg`` (``store``: a
    connection of this notice's own), last seen in round ``where[0]`` whose ranks were
    ``where[1]``, and log it; None when it could not be written (logged). ``returning``: the
    launcher respawns ``r`` (see :func:`write_notice`)."""
    try:
        done = write_notice(store, cfg, r, where[0], where[1], cause, returning=returning)
    except Exception:
        logger.exception("could not write the notice that rank %d is gone", r)
        return None
    logger.warning(
        "rank %d gone in round %d (%s); notice written in %.1f ms (counted: %s)",
        r,
        done.gone_round,
        cause,
        1000 * done.duration,
        done.counted,
    )
    return done


def latest_position(store: StoreLike, cfg: SidecarConfig) -> tuple[int, tuple[int, ...]]:
    """The latest round the store published (:attr:`Keyspace.latest`) and its roster;
    ``(-1, ())`` before the first. What a notice starts from when nobody here saw the rank in
    a round: should the rank already be at the next round's barrier, :func:`write_notice`
    follows it there."""
    raw = peek(store, cfg.keys.latest)
    if raw is None:
        return -1, ()
    ready = _records.layout(raw)
    return ready.round, tuple(ready.roster)


def notify_anew(
    cfg: SidecarConfig, r: int, where: tuple[int, tuple[int, ...]] | None, cause: str
) -> Notice | None:
    """The final (not returning) notice of rank ``r`` in the wrapped call of ``cfg``, on a new
    connection to its store: last seen in round ``where[0]`` whose ranks were ``where[1]``
    (None: nobody here saw it in a round, the store's :func:`latest_position` is taken).
    None when it could not be written (logged)."""
    try:
        store = connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
        if where is None:
            where = latest_position(store, cfg)
    except Exception as exc:
        logger.error("could not write the notice that rank %d is gone: %s", r, exc)
        return None
    return notify(store, cfg, r, where, cause, returning=False)
