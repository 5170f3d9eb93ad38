"""The demo workload: data is a pure function of (seed, step, rank), the loss falls, and a
resume from a saved state is bit-identical to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from trainguard.demo.model import (
    TaskConfig,
    batch,
    make_model,
    make_optimizer,
    make_teacher,
    parameters_digest,
    train_step,
    training_state,
)
from trainguard.errors import ConfigError


def test_batches_depend_only_on_seed_step_and_rank() -> None:
    cfg = TaskConfig()
    teacher = make_teacher(cfg)
    x1, y1 = batch(cfg, teacher, 7, 1)
    x2, y2 = batch(cfg, make_teacher(cfg), 7, 1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(batch(cfg, teacher, 7, 2)[0], x1)
    assert not torch.equal(batch(cfg, teacher, 8, 1)[0], x1)


def test_loss_falls() -> None:
    cfg = TaskConfig()
    teacher, model = make_teacher(cfg), make_model(cfg)
    opt = make_optimizer(model, cfg)
    losses = [train_step(model, opt, *batch(cfg, teacher, s, 0), world_size=1) for s in range(150)]
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:5]) / 5


def test_resume_is_bit_identical() -> None:
    cfg = TaskConfig()
    teacher = make_teacher(cfg)

    def run(steps: range, model, opt) -> None:
        for s in steps:
            train_step(model, opt, *batch(cfg, teacher, s, 0), world_size=1)

    straight = make_model(cfg)
    opt = make_optimizer(straight, cfg)
    run(range(40), straight, opt)

    first = make_model(cfg)
    opt1 = make_optimizer(first, cfg)
    run(range(25), first, opt1)
    saved = {"model": first.state_dict(), "optim": opt1.state_dict()}
    resumed = make_model(cfg)
    opt2 = make_optimizer(resumed, cfg)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    run(range(25, 40), resumed, opt2)
    assert parameters_digest(resumed) == parameters_digest(straight)
    resumed.state_dict()["0.weight"].view(-1)[0] += 1e-6  # one perturbed value is caught
    assert parameters_digest(resumed) != parameters_digest(straight)


def _state_bytes(state: object) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    return 0


def test_model_mib_pads_the_checkpointed_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pad_mib`` makes the checkpointed state (after a step: AdamW's moments exist) about that
    size; 0, the default, leaves the model as it was; the environment variable sets the default
    (``trainguard demo --model-mib`` passes it to the processes it starts that way)."""
    monkeypatch.delenv("TRAINGUARD_DEMO_MODEL_MIB", raising=False)

    def trained_state(cfg: TaskConfig) -> tuple[int, list[str]]:
        teacher, model = make_teacher(cfg), make_model(cfg)
        opt = make_optimizer(model, cfg)
        train_step(model, opt, *batch(cfg, teacher, 0, 0), world_size=1)
        return _state_bytes(training_state(model, opt, 1)), sorted(model.state_dict())

    small, keys = trained_state(TaskConfig())
    assert TaskConfig().pad_mib == 0 and "pad" not in keys and small < 1 << 20
    padded, padded_keys = trained_state(TaskConfig(pad_mib=8))
    assert padded_keys == sorted([*keys, "pad"])
    assert abs(padded - (8 << 20)) < 64 << 10, padded  # within 64 KiB of 8 MiB
    monkeypatch.setenv("TRAINGUARD_DEMO_MODEL_MIB", "3")
    assert TaskConfig().pad_mib == 3
    assert parameters_digest(make_model(TaskConfig())) == parameters_digest(
        make_model(TaskConfig(pad_mib=3))
    )  # the same on every rank and in every run
    with pytest.raises(ConfigError, match="0 \\(no padding\\) or more"):
        TaskConfig(pad_mib=-1)
    monkeypatch.setenv("TRAINGUARD_DEMO_MODEL_MIB", "lots")
    with pytest.raises(ConfigError, match="--model-mib"):
        TaskConfig()
