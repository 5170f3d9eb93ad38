"""The narrow interface through which :mod:`trainguard.restart` runs straggler detection.

Restart imports only this module of the package (besides its public face): the per-rank step
and section timer (:class:`Timer`, kept by ``CallWrapper``) and the round's detector
(:class:`StragglerWatch`, started and stopped by the wrapped call each round). The detector
reaches the round only through what it is given: the round's keys, a store clone factory, a
``propose`` callable for the round's outcome, and a :class:`RoundView` of the round's state;
nothing in this package imports :mod:`trainguard.restart`. Internal: the names may change in
any release; users use :mod:`trainguard.stragglers`.
"""

from __future__ import annotations

from trainguard.stragglers._timing import Section, Timer, section
from trainguard.stragglers._watch import RoundView, StragglerWatch

__all__ = ["RoundView", "Section", "StragglerWatch", "Timer", "section"]
