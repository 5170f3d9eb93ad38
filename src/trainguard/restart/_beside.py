"""The threads and the helper that one wrapped call runs beside its function.

:meth:`~trainguard.restart._run.WrappedCall._start` builds them, in this order, once the
call's session is open (its coordination connection and round book exist): the straggler
watch (only with ``stragglers=``), the helper that watches this process (the node watcher or
the launcher's agent, :mod:`._helper`; only with ``sidecar=True``, its handshake done before
anything else runs), the monitor thread (it watches the round's
outcome and aborts), and the progress watchdog (hangs). Each factory here takes what its
helper needs and nothing of the call itself, so the round's code reads what it uses;
:meth:`~trainguard.restart._run.WrappedCall._stop` stops them in the reverse order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.restart import _diagnose
from trainguard.restart._helper import HelperHandle, start_for
from trainguard.restart._session import Session
from trainguard.restart.call import CallWrapper
from trainguard.restart.config import WrapperConfig
from trainguard.restart.monitor import Monitor, MonitorHooks
from trainguard.restart.state import RoundOutcome
from trainguard.restart.watchdog import Watchdog
from trainguard.stragglers.round import StragglerWatch

__all__ = ["make_monitor", "make_sidecar", "make_stragglers", "make_watchdog"]


def make_stragglers(cfg: WrapperConfig, session: Session, rank: int) -> StragglerWatch | None:
    """The straggler detector, which reaches the round only through what it is given here."""
    if not cfg.stragglers:
        return None
    return StragglerWatch(
        cfg.stragglers,
        session.keys,
        clone=session.clone_coord,
        propose=lambda n, why: session.stop(n, RoundOutcome.fault(rank, why, "Straggler")),
        timeout=cfg.store_timeout,
    )


def make_sidecar(
    cfg: WrapperConfig, session: Session, rank: int, log_dir: Path | None
) -> HelperHandle | None:
    """The rank's helper, started and past its handshake (``None`` without ``sidecar=``)."""
    if not cfg.sidecar:
        return None
    assert session.coord_addr is not None
    sidecar = start_for(
        cfg, session.keys, session.coord_addr, rank=rank, world=session.world, log_dir=log_dir
    )
    sidecar.handshake(cfg.store_timeout)
    return sidecar


def make_monitor(
    cfg: WrapperConfig,
    session: Session,
    sidecar: HelperHandle | None,
    hooks: MonitorHooks,
) -> Monitor:
    """The monitor thread of the calling (main) thread's function."""
    return Monitor(
        session.watch(sidecar),
        session.keys,
        threading.get_ident(),
        hooks=hooks,
        abort_timeout=cfg.abort_timeout,
        setup_cap=cfg.barrier_timeout - cfg.abort_timeout,
        source=session.outcome,
    )


def make_watchdog(
    cfg: WrapperConfig,
    session: Session,
    rank: int,
    state: Callable[[], tuple[int, bool, CallWrapper | None]],
    sidecar: HelperHandle | None,
) -> Watchdog:
    """The progress watchdog of the calling (main) thread: a hang proposes a fault through
    the round book, on the coordination connection (never blocked for long)."""
    book: Any = session.book
    assert book is not None
    return Watchdog(
        thread_id=threading.get_ident(),
        state=state,
        on_hang=lambda n, why: _diagnose.record_hang(book, rank, n, why),
        soft_timeout=cfg.soft_timeout,
        interval=min(0.1, cfg.soft_timeout / 20),
        sidecar=sidecar,
    )
