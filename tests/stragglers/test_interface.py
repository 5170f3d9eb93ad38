"""The straggler detector reaches the round only through the narrow interface it is given
(a keyspace, a store clone factory, a ``propose`` callable): it never imports ``restart``."""

from __future__ import annotations

import subprocess
import sys


def test_the_detector_imports_nothing_of_restart() -> None:
    code = (
        "import sys, trainguard.stragglers, trainguard.stragglers._watch; "
        "print(sorted(m for m in sys.modules if m.startswith('trainguard.restart')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_restart_round_state_is_a_round_view() -> None:
    """What the detector reads of a round, ``RoundView``, is what ``RoundState`` has."""
    from trainguard.restart.state import RoundState
    from trainguard.stragglers._watch import RoundView

    state = RoundState(round=2, initial_rank=3, initial_world_size=4, rank=1, active_ranks=(0, 3))
    view: RoundView = state  # mypy checks the structure; the attributes are read below
    assert (view.round, view.initial_rank, view.rank, tuple(view.active_ranks)) == (2, 3, 1, (0, 3))
