"""A commit round through a ``torch.distributed.Store``: every participant reports, the outcome
is decided once.

Used by both checkpointers (a multi-rank checkpoint is committed only when every rank's part is
durable). Each of the ``world_size`` participants of a round calls :meth:`CommitRound.report`
once, then :meth:`CommitRound.wait` (or :meth:`CommitRound.poll`), then
:meth:`CommitRound.close`. Keys under the round's prefix ``P``::

    P/err/<r>     why participant r failed (only on failure)
    P/done/<r>    participant r reported (ok or not)
    P/count       add(): how many reported
    P/decision    the one decision, set with compare_set (first decision wins)
    P/outcome     the decision, published by whoever made it once it has acted on it
    P/seen        add(): how many read the outcome; the last one deletes P's keys

Protocol:

1. A participant reports: ``set(err/r)`` on failure, ``set(done/r)``, ``n = add(count, 1)``.
2. The participant whose report makes ``n == world_size`` checks every report. Only when every
   participant reported success (and its ``prepare`` step succeeds) it proposes "committed",
   else "failed" naming each failed participant. It proposes with ``compare_set`` on
   ``P/decision``: if a decision is already there (see 3), that one holds and is all it acts on.
3. A participant that waits longer than its timeout, or that gives the round up
   (:meth:`CommitRound.abandon`), proposes "failed" the same way; a late report can then never
   commit the round.
4. Whoever's proposal became the decision publishes it on ``P/outcome``: a "failed" decision at
   once, a "committed" one after its ``act`` step (e.g. renaming a commit marker into place), so
   that every participant that sees "committed" can rely on what the act did. Every participant
   acts only on the published outcome. A participant that finds the decision "committed" but
   no outcome published in time gets the state ``"unconfirmed"``: an error, but it must not
   undo its part (the decider may have committed it).
5. Each participant adds one to ``P/seen`` after reading the outcome; the last deletes the keys.

Each participant costs O(1) store operations (the deciding one reads every report: O(N) once).
No participant polls: waits are ``Store.wait`` on a client of the caller's own (``wait`` holds
a TCPStore client for its whole duration: never share it with a thread that needs it meanwhile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from trainguard.coord.barrier import wait_all
from trainguard.coord.keys import decode, encode
from trainguard.coord.store import as_store
from trainguard.errors import CoordinationError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["COMMITTED", "FAILED", "UNCONFIRMED", "CommitRound", "Outcome"]

logger = logging.getLogger(__name__)

COMMITTED = "committed"
FAILED = "failed"
UNCONFIRMED = "unconfirmed"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The outcome of a commit round, the same for every participant.

    ``state`` is :data:`COMMITTED`, :data:`FAILED` (undo your part) or :data:`UNCONFIRMED`
    (decided "committed", but the decider did not confirm it in time: an error, keep your part).
    ``causes`` maps each participant that failed (or gave up, or never reported) to why.
    ``decider`` is the participant whose decision holds.
    """

    state: str
    causes: Mapping[int, str]
    decider: int

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    def encode(self) -> str:
        causes = {str(r): why for r, why in self.causes.items()}
        return encode({"state": self.state, "causes": causes, "by": self.decider}).decode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Outcome:
        try:
            doc = decode(raw)
            if not isinstance(doc, dict) or doc.get("state") not in (COMMITTED, FAILED):
                raise ValueError("no state")
            causes = {int(r): str(why) for r, why in dict(doc.get("causes", {})).items()}
            by = doc.get("by", -1)
            if type(by) is not int:
                raise ValueError("bad decider")
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
            raise CoordinationError(
                f"malformed commit outcome in the store: {raw!r:.200}"
            ) from None
        return cls(str(doc["state"]), causes, by)


class CommitRound:
    """One participant's view of the commit round at ``prefix`` (see the module docstring).

    Args:
        store: a client of the store, used by one thread at a time.
        prefix: the round's key prefix; the same on every participant, unique to the round.
        rank: this participant, in ``range(world_size)``.
        world_size: how many participants report.
    """

    def __init__(self, store: Store, prefix: str, *, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def report(
        self,
        error: str | None = None,
        *,
        prepare: Callable[[], None] | None = None,
        act: Callable[[], None] | None = None,
        discard: Callable[[], None] | None = None,
    ) -> Outcome | None:
        """Report this participant's result (``error`` None: its part is ready); never waits.

        When this report is the last one, this participant decides: ``prepare()`` runs first
        when every report is a success (an exception fails the round, naming this
        participant); then, if its "committed" became the decision, ``act()`` (an exception
        publishes "failed" instead: ``act`` must leave nothing behind when it raises),
        otherwise ``discard()`` undoes ``prepare``. Returns the published outcome when this
        call published it, else None (read it with :meth:`wait` or :meth:`poll`).

        Raises :class:`CoordinationError` when more participants report than ``world_size``
        (two jobs share one key prefix).
        """
        if error is not None:
            self.store.set(self._key(f"err/{self.rank}"), error)
        self.store.set(self._key(f"done/{self.rank}"), "1")
        count = int(self.store.add(self._key("count"), 1))
        if count > self.world_size:
            raise CoordinationError(
                f"{count} reports at {self.prefix} for {self.world_size} participants; two jobs "
                "share one key prefix? set TRAINGUARD_JOB_ID (or key_prefix) to a value unique "
                "to the job"
            )
        if count < self.world_size:
            return None
        causes = self._failures()
        if not causes and prepare is not None:
            try:
                prepare()
            except Exception as exc:
                causes[self.rank] = f"{type(exc).__name__}: {exc}"
        state = FAILED if causes else COMMITTED
        proposal = Outcome(state, causes, self.rank)
        held = self._decide(proposal)
        if held != proposal:
            if discard is not None and state == COMMITTED:
                discard()
            return None
        if held.committed and act is not None:
            try:
                act()
            except Exception as exc:
                logger.warning("commit at %s could not be completed: %s", self.prefix, exc)
                held = Outcome(FAILED, {self.rank: f"{type(exc).__name__}: {exc}"}, self.rank)
        self.store.set(self._key("outcome"), held.encode())
        return held

    def abandon(self, reason: str) -> bool:
        """Fail the round unless it is decided already; True when this call decided it.

        Participants waiting in :meth:`wait` wake at once with ``reason`` as this
        participant's cause. Any participant may call it, once or more, before or after its own
        :meth:`report` (on a client other than one a :meth:`wait` holds).
        """
        return self._fail({self.rank: reason}) is not None

    def poll(self) -> Outcome | None:
        """The published outcome, or None when it is not published yet; never waits."""
        key = self._key("outcome")
        if not self.store.check([key]):
            return None
        return Outcome.decode(self.store.get(key))

    def wait(self, timeout: float) -> Outcome:
        """Wait up to ``timeout`` seconds for the published outcome.

        On a timeout this participant proposes "failed", naming the participants that never
        reported; if its proposal holds, that is the outcome. If a "committed" decision holds
        instead, it waits up to ``timeout`` again for the decider to publish it, then returns
        an :data:`UNCONFIRMED` outcome.
        """
        key = self._key("outcome")
        store = as_store(self.store)
        if wait_all(store, [key], timeout, what=f"the commit outcome at {self.prefix}"):
            return Outcome.decode(self.store.get(key))
        missing = [
            r for r in range(self.world_size) if not self.store.check([self._key(f"done/{r}")])
        ]
        causes = {r: f"did not report within {timeout:g} s (died or hung?)" for r in missing}
        mine = self._fail(causes or {self.rank: f"no commit outcome within {timeout:g} s"})
        if mine is not None:
            return mine
        if wait_all(store, [key], timeout):
            return Outcome.decode(self.store.get(key))
        held = Outcome.decode(self.store.get(self._key("decision")))
        if held.failed:  # its maker is publishing it right now
            return held
        return Outcome(
            UNCONFIRMED,
            {held.decider: f"decided to commit but did not confirm within {timeout:g} s"},
            held.decider,
        )

    def close(self) -> None:
        """Count this participant as done with the round; the last one deletes its keys."""
        if int(self.store.add(self._key("seen"), 1)) < self.world_size:
            return
        names = ["count", "decision", "outcome", "seen"]
        names += [f"{kind}/{r}" for r in range(self.world_size) for kind in ("err", "done")]
        for name in names:
            with contextlib.suppress(Exception):  # best effort: a missing key is fine
                self.store.delete_key(self._key(name))

    # ------------------------------------------------------------------ internals

    def _failures(self) -> dict[int, str]:
        causes: dict[int, str] = {}
        for r in range(self.world_size):
            key = self._key(f"err/{r}")
            if self.store.check([key]):
                causes[r] = bytes(self.store.get(key)).decode(errors="replace")
        return causes

    def _decide(self, proposal: Outcome) -> Outcome:
        """Propose ``proposal`` with compare_set; returns the decision that holds."""
        held = self.store.compare_set(self._key("decision"), "", proposal.encode())
        return Outcome.decode(held)

    def _fail(self, causes: dict[int, str]) -> Outcome | None:
        """Propose "failed"; when that became the decision, publish it and return it."""
        proposal = Outcome(FAILED, causes, self.rank)
        held = self._decide(proposal)
        if held != proposal:
            return None
        self.store.set(self._key("outcome"), held.encode())
        return held
