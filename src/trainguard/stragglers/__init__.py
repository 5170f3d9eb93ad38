"""Straggler detection: find the rank that is alive but slow, say why, optionally replace it.

    import trainguard.restart as tr
    from trainguard.stragglers import Stragglers, TakeOutStragglers

    @tr.Wrapper(stragglers=Stragglers(every=50), rank_assignment=tr.FillGaps(), ...)
    def train(call: tr.CallWrapper):
        for step in ...:
            with call.section("data"):
                batch = next(loader)
            with call.section("compute"):
                loss = model(batch).backward()
            optimizer.step()
            call.ping()                       # ends a step

Each active rank measures its step time and the sections it names (:mod:`._timing`); every
``every`` steps the ranks exchange their medians through the round's store, never the
training process group (:mod:`._watch`), and score each other (:mod:`.scores`). A rank that
stays slower than the fastest one emits ``straggler`` events, ``trainguard report`` lists the
slowest ranks, and with ``Stragglers(take_out=TakeOutStragglers(...))`` a persistent straggler
leaves the job so that a spare takes its number. Importing this package imports no torch.
"""

from __future__ import annotations

from trainguard.stragglers._timing import Section, section
from trainguard.stragglers.config import Stragglers, TakeOutStragglers
from trainguard.stragglers.scores import RankScore

__all__ = ["RankScore", "Section", "Stragglers", "TakeOutStragglers", "section"]
