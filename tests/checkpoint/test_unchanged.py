"""A save whose tensors equal the previous save's is reported (issue 33, item 3): the silent
failure of an async checkpoint that snapshots tensors training no longer updates."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import AsyncCheckpointer


def _reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "exactly the same tensors" in r.getMessage()]


def test_a_stale_save_is_reported_and_a_changing_one_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = torch.nn.Linear(64, 64)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}  # the bug: a copy, once
    with caplog.at_level(logging.WARNING, logger="trainguard"), AsyncCheckpointer() as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)  # training changes the live parameters
            ckpt.save({"model": model.state_dict(), "step": step}, tmp_path / f"live{step}")
            ckpt.wait()
        assert _reports(caplog) == []  # each save differs from the one before
        for step in (4, 5):
            ckpt.save({"model": frozen, "step": step}, tmp_path / f"stale{step}")
            ckpt.wait()
        ckpt.save({"model": frozen, "step": 5}, tmp_path / "stale5")  # same path: not a new step
        ckpt.wait()
    reports = _reports(caplog)
    assert len(reports) == 1, reports
    assert "stale5" in reports[0] and "stale4" in reports[0]


def test_a_state_without_tensors_is_never_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard"), AsyncCheckpointer() as ckpt:
        for step in (1, 2):
            ckpt.save({"step": 7, "note": "same"}, tmp_path / f"s{step}")
            ckpt.wait()
    assert _reports(caplog) == []
