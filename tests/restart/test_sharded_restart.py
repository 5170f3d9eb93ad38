"""In-process restart with sharded state: 4 ranks train an FSDP2 model (Adam) under the Wrapper
with local checkpoints; a rank is SIGKILLed. Without a spare the 3 survivors load the newest
local iteration resharded into 3 ranks and go on; with a spare the world stays 4 and the result
is bit-identical to a fault-free run. Real processes, real gloo, real store (tests/_dist.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from tests._dist import free_port, run_ranks
from tests.restart import _sharded

KILL_STEP = 7  # after the save of iteration 6 (saves every 3 steps), before that of 9


def _run(tmp_path: Path, world: int, victim: int, *, spare: bool) -> list:
    results = run_ranks(
        _sharded.sharded_job,
        world,
        args=(str(tmp_path), _sharded.STEPS, victim, KILL_STEP, spare, free_port()),
        timeout=150,
    )
    assert (tmp_path / "killed").exists(), "the victim was not killed"
    assert results[victim].exitcode == -9, results[victim]
    return results


def _assert_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same keys, and bit for bit the same tensors (sent by the ranks as numpy arrays)."""
    assert sorted(got) == sorted(expected)
    for key in expected:
        a, b = torch.from_numpy(got[key]), torch.from_numpy(expected[key])
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), f"{key}: {a} != {b}"


@pytest.mark.timeout(240)
def test_survivors_reshard_the_newest_local_checkpoint_into_three_ranks(tmp_path: Path) -> None:
    victim = 2
    results = _run(tmp_path, 4, victim, spare=False)
    survivors = [r for r in range(4) if r != victim]
    finals = []
    for new_rank, rank in enumerate(survivors):
        value = results[rank].get()
        rounds = value["rounds"]
        assert [(x["round"], x["rank"], x["world"], x["found"]) for x in rounds] == [
            (0, rank, 4, None),
            (1, new_rank, 3, 6),
        ]
        assert rounds[1]["step"] == 6  # training continued from the checkpointed step
        assert sorted(value["saved"]) == [3, 6, 9]  # 9: saved in round 1
        # what the 3 ranks hold after the load, gathered, is what the 4 ranks had saved:
        # parameters and Adam's moments and step counts
        _assert_equal(rounds[1]["loaded"], value["saved"][6])
        assert any(k.startswith("optim.state.") for k in value["saved"][6])
        finals.append(value["final"])
    assert all(set(f) == {"0.weight", "0.bias", "2.weight", "2.bias"} for f in finals)
    for final in finals[1:]:
        _assert_equal(final, finals[0])
    # the same steps on the same global batches as the fault-free 4-rank run: only the order
    # of the gradient sums differs from step 6 on
    reference = results[0].get()["reference"]
    for key, value in finals[0].items():
        assert numpy.allclose(value, reference[key], rtol=1e-4, atol=1e-6), key
        assert not numpy.array_equal(value, results[0].get()["saved"][6]["model." + key])


@pytest.mark.timeout(240)
def test_with_a_spare_the_result_is_bit_identical_to_a_fault_free_run(tmp_path: Path) -> None:
    victim = 1
    results = _run(tmp_path, 5, victim, spare=True)
    values = {r.rank: r.get() for r in results if r.rank != victim}
    reference = values[0]["reference"]
    for rank in (2, 3):
        _assert_equal(values[rank]["reference"], reference)  # the reference is one run
    for rank, value in values.items():
        seen = [(x["round"], x["rank"], x["world"], x["found"]) for x in value["rounds"]]
        if rank == 4:  # the spare takes the dead rank's number in round 1
            assert seen == [(1, victim, 4, 6)]
        else:
            assert seen == [(0, rank, 4, None), (1, rank, 4, 6)]
            _assert_equal(value["rounds"][1]["loaded"], value["saved"][6])
        assert value["rounds"][-1]["step"] == 6
        _assert_equal(value["final"], reference)  # bit for bit
