"""Moving an :class:`~trainguard.checkpoint.AsyncCheckpointer` from one round to the next.

The checkpointer's writer process, staging buffer and background thread live as long as it
does; its commit thread (:class:`~._commit.Committer`) belongs to one round: it counts parts in
that round's store, for that round's world. :class:`RoundBinding` is the round it is bound to
(rank, world size, committer), which its save worker reads too; it notices a new round (the
default process group changed). :func:`retire` ends a round's commits: the saves
still waiting for other ranks are given up (after a fault the round's store is gone and some
rank may be dead: they could never commit), the commit thread stops, and the outcomes are
taken off the result queue and logged, so that the next round does not raise them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from trainguard import events
from trainguard.checkpoint import _link
from trainguard.checkpoint._commit import Committer
from trainguard.checkpoint._saves import Outcomes

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)


class RoundBinding:
    """The round a checkpointer is bound to: this rank, the world size, whether the ranks
    commit together, and the round's committer (None: a single process, or between rounds).

    The checkpointer's training thread binds it (:meth:`bind`); its save worker reads it.
    ``key_prefix`` and ``timeout`` (the commit timeout) are the checkpointer's settings.
    """

    def __init__(self, *, key_prefix: str = "trainguard/ckpt", timeout: float = 300.0) -> None:
        self._key_prefix, self._timeout = key_prefix, timeout
        self.committer: Committer | None = None
        self.rank = 0
        self.world_size = 1
        self.distributed = False
        self._watch: _link.RoundWatch | None = None

    def bind(
        self,
        store: Store | None,
        rank: int | None,
        world_size: int | None,
        *,
        started: float,
    ) -> None:
        """Bind to this round: the store, this rank and the world size (given, or the default
        process group's); with a store, a commit thread."""
        self._watch = _link.RoundWatch(
            _link.default_group(), explicit=(store, rank, world_size) != (None, None, None)
        )
        given, self.rank, self.world_size = _link.resolve(store, rank, world_size)
        self.distributed = given is not None
        if given is not None:
            link = _link.StoreLink.join(
                given, key_prefix=self._key_prefix, world_size=self.world_size
            )
            self.committer = Committer(
                link, rank=self.rank, world_size=self.world_size, timeout=self._timeout
            )
        _link.setup_done("async", started, self.rank, self.world_size)

    def changed(self) -> bool:
        """Whether a new round began since :meth:`bind` (the default process group changed)."""
        return self._watch is not None and self._watch.changed()

    def close(self) -> None:
        committer, self.committer = self.committer, None
        if committer is not None:
            committer.close()


def set_event(event: threading.Event) -> None:
    """A job for the checkpointer's thread: it has handled every item queued before."""
    event.set()


def retire(slot: RoundBinding, outcomes: Outcomes, timeout: float) -> None:
    """End the round of ``slot``'s committer; see the module docstring. ``outcomes``: the
    checkpointer's saves not finished yet and their reported outcomes."""
    committer = slot.committer
    open_ = outcomes.open()
    if committer is not None and open_:
        committer.abandon([h.commit_key for h in open_], "abandoned: the round ended")
        events.emit("ckpt_abandoned", paths=[h.path for h in open_])
    deadline = time.monotonic() + timeout
    for handle in open_:
        if not handle.finished.wait(max(0.0, deadline - time.monotonic())):
            logger.warning("the commit of %s did not end with its round", handle.path)
    slot.close()
    outcomes.deliver(logged=True)
