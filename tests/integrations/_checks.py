"""Assertions shared by the framework tests: rounds, faults, weights, leftovers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy

from tests._dist import RankResult


def check_fault_run(results: list[RankResult], out: Path, steps: int) -> dict[str, Any]:
    """The run with faults went as planned, and ended with the reference's weights.

    Process 0 raised at step 6 of round 0 (round 1 resumed from step 4), process 1 was
    SIGKILLed at step 10 of round 1, and the spare (process 2) took rank 1 in round 2, which
    resumed from step 8 and ended at ``steps``. Returns process 0's values."""
    assert (out / "faulty" / "killed").exists(), "the victim was not killed"
    assert results[1].exitcode == -9, results[1]
    values = {r.rank: r.get() for r in results if r.rank != 1}
    first, spare = values[0], values[2]
    rounds = [(r["round"], r["rank"], r["resumed"]) for r in first["faulty"]["rounds"]]
    assert rounds == [(0, 0, None), (1, 0, 4), (2, 0, 8)], first["faulty"]["rounds"]
    assert first["faulty"]["rounds"][-1]["step"] == steps
    assert [(r["round"], r["rank"], r["resumed"]) for r in spare["faulty"]["rounds"]] == [(2, 1, 8)]
    assert spare["reference"]["rounds"] == []  # a spare that never trained
    assert [r["step"] for r in first["reference"]["rounds"]] == [steps]
    for final in (first["faulty"]["final"], spare["faulty"]["final"]):
        assert sorted(final) == sorted(first["reference"]["final"])
        for key, value in first["reference"]["final"].items():
            assert numpy.array_equal(final[key], value), f"{key} differs from the reference"
    for value in values.values():
        assert not [t for t in value["threads"] if t != "MainThread"], value["threads"]
    return first
