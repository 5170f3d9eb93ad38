"""The short soak (bench/soak.py with 10 faults): every fault kind once or more, real processes.

One run is shared by the tests of this module. The schedule of seed 0 holds every kind,
and its three leaving faults (kill, kill, the node watcher's loss) force job-level restarts.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._soak_plan import KINDS, draw_schedule, steps_for  # noqa: E402

pytestmark = [
    pytest.mark.soak,  # in `make test`; `make soak-test` runs these alone
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the soak mounts a tmpfs for its full-disk fault (run as root)"
    ),
]

ARGS = ["--faults", "10", "--seed", "0", "--gap", "8", "--disk-every", "8"]
ARGS += ["--soft-timeout", "2", "--stall", "60", "--timeout", "200"]


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("soak")
    proc = subprocess.run(
        [
            sys.executable,
            "bench/soak.py",
            *ARGS,
            "--out",
            str(out / "run"),
            "--json",
            str(out / "soak.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (out / "soak.json").exists(), proc.stdout + proc.stderr
    return json.loads((out / "soak.json").read_text()), proc.stdout + proc.stderr


def test_schedule_is_drawn_from_the_seed() -> None:
    a = draw_schedule(7, 14, ranks=4, gap=12, local_every=4, disk_every=12)
    assert a == draw_schedule(7, 14, ranks=4, gap=12, local_every=4, disk_every=12)
    assert a != draw_schedule(8, 14, ranks=4, gap=12, local_every=4, disk_every=12)
    assert sorted(f.kind for f in a) == sorted(KINDS * 2)
    steps = [f.step for f in a]
    assert steps == sorted(steps) and min(b - a for a, b in itertools.pairwise(steps)) >= 6
    assert max(steps) < steps_for(14, 12) - 12
    for f in a:
        if f.kind == "diskfull":
            assert (f.step + 1) % 12 == 0  # right before a disk save


@pytest.mark.timeout(300)
def test_short_soak_is_bit_identical(soak: tuple[dict[str, Any], str]) -> None:
    res, text = soak
    assert res["checks"]["finished"], text
    assert res["checks"]["bit_identical"], text


@pytest.mark.timeout(300)
def test_every_committed_checkpoint_verifies(soak: tuple[dict[str, Any], str]) -> None:
    res, text = soak
    assert res["checks"]["checkpoints_verify"], text
    assert len(res["disk"]["committed"]) >= 3


@pytest.mark.timeout(300)
def test_every_fault_kind_was_injected_and_recovered(soak: tuple[dict[str, Any], str]) -> None:
    res, text = soak
    assert set(res["mix"]) == set(KINDS)
    for kind, mix in res["mix"].items():
        assert mix["injected"] == mix["planned"] == mix["recovered"], (kind, text)
    assert res["checks"]["all_injected"] and res["checks"]["all_recovered"], text
    assert res["segments"] >= 2 and res["job_restarts"][0]["restart_s"] is not None
    assert not res["problems"], text


@pytest.mark.timeout(300)
def test_nothing_left_behind(soak: tuple[dict[str, Any], str]) -> None:
    res, _ = soak
    assert res["checks"]["nothing_left"], res["leaks"]


@pytest.mark.timeout(300)
def test_no_descriptor_left_after_the_wrapper_returns(soak: tuple[dict[str, Any], str]) -> None:
    """Every process, whether its Wrapper returned or raised (the job ended and restarts),
    holds no descriptor it did not hold before the call."""
    res, _ = soak
    assert res["fds_left_by_process"], "no process returned"
    assert res["checks"]["no_fds_after_return"], res["fds_after_return"]
