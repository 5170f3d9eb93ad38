"""Lightning under ``trainguard launch``: no step lost to a SIGKILL with a spare.

Three workers (2 active ranks and a spare) run the Lightning job of ``_lightning_job`` (DDP
through RoundStrategy, LocalCheckpointCallback with live state) under the in-process restart
Wrapper (``_launched_trainer.py``). Process 0 raises at step 6 of round 0, process 1 SIGKILLs
itself at step 10 of round 1; the launcher respawns it, the spare takes its rank. Both rounds
resume from live state where the fault struck, mid-epoch (6 and 10: nothing recomputed; the
spare receives the state from rank 0, the plain dataloader skips the epoch's consumed
batches), and the job ends with the weights of the same job launched without faults, bit for
bit, with no process left behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest

from tests.integrations._checks import STEPS, launch_job

pytest.importorskip("lightning")


@pytest.mark.timeout(450)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_sigkill_with_a_spare_under_the_launcher_recomputes_no_step(tmp_path: Path) -> None:
    reference = launch_job(tmp_path / "reference", False, "lightning")
    faulty = launch_job(tmp_path / "faulty", True, "lightning")
    assert (tmp_path / "faulty" / "killed").exists(), "the victim was not killed"

    (first,) = faulty[0]
    rounds = [(r["round"], r["rank"], r["resumed"], r["source"]) for r in first["rounds"]]
    assert rounds == [(0, 0, None, None), (1, 0, 6, "live"), (2, 0, 10, "live")], rounds
    assert first["rounds"][-1]["step"] == STEPS
    (spare,) = faulty[2]
    assert [(r["round"], r["rank"], r["resumed"], r["source"]) for r in spare["rounds"]] == [
        (2, 1, 10, "live")
    ], spare["rounds"]
    respawned = [r for r in faulty[1] if r["incarnation"] == "1"]
    assert len(respawned) == 1 and respawned[0]["final"] is None  # it waited as the spare

    want = reference[0][0]["final"]
    assert reference[0][0]["rounds"][-1]["step"] == STEPS
    for final in (first["final"], spare["final"]):
        assert sorted(final) == sorted(want)
        for key, value in want.items():
            assert numpy.array_equal(numpy.asarray(final[key]), numpy.asarray(value)), key
