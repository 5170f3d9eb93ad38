"""Writing one death notice for a watch, and logging it: :func:`notify`.

Used by :class:`~trainguard.restart.sidecar._watch.Watch` (a rank it declared silent, or its
own training process's death) and by the launcher's sidecar service. The notice itself (what
it changes in the store) is :func:`~trainguard.restart.sidecar._notice.write_notice`'s.
"""

from __future__ import annotations

import logging

from trainguard.coord.store import StoreLike
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._notice import Notice, write_notice

logger = logging.getLogger("trainguard.restart.sidecar")


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
