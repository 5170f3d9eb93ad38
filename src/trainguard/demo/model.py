"""The demo's workload: a student network learns a fixed random teacher network.

Everything is a pure function of a seed and the step counter, so the data of step ``s`` on
rank ``r`` is the same whether the job ran straight through or restarted at any point, and a
resumed run is bit-identical to an uninterrupted one when the model, optimizer and step are
restored from a checkpoint.

The teacher maps ``x`` to class scores through a small random MLP; the student is a wider
MLP trained with cross-entropy on the teacher's argmax labels, so the loss falls steadily from
``ln(classes)`` over a few hundred steps.

``TaskConfig.pad_mib`` (``trainguard demo --model-mib N``) makes the checkpointed state about
``N`` MiB per rank, to measure checkpoints and recovery at a realistic size: the student then
carries a fixed buffer ``pad`` (zeros, part of ``state_dict``, so it is saved,
restored and covered by the bit-identical check) while the trained part stays as small as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard import _env
from trainguard.errors import ConfigError


def _pad_from_env() -> int:
    return _env.settings().demo_model_mib


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Shape of the demo task. Small enough for a few hundred steps on 2 CPU cores.

    ``pad_mib``: pad the checkpointed state (model, optimizer, step, RNG) to about this many
    MiB per rank (0: no padding); defaults to ``TRAINGUARD_DEMO_MODEL_MIB``, which
    ``trainguard demo --model-mib`` sets for the processes it starts.
    """

    seed: int = 1234
    inputs: int = 32
    classes: int = 8
    hidden: int = 128
    batch: int = 64  # per rank
    lr: float = 3e-3
    pad_mib: int = dataclasses.field(default_factory=_pad_from_env)

    def __post_init__(self) -> None:
        if isinstance(self.pad_mib, bool) or not isinstance(self.pad_mib, int):
            raise ConfigError(f"pad_mib={self.pad_mib!r} must be a whole number of MiB")
        if self.pad_mib < 0:
            raise ConfigError(f"pad_mib={self.pad_mib}: give 0 (no padding) or more MiB")


def make_teacher(cfg: TaskConfig) -> nn.Module:
    gen = torch.Generator().manual_seed(cfg.seed)
    teacher = nn.Sequential(nn.Linear(cfg.inputs, 64), nn.Tanh(), nn.Linear(64, cfg.classes))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    teacher.requires_grad_(False)
    return teacher


def make_model(cfg: TaskConfig) -> nn.Module:
    """The student, initialized from the seed (identical on every rank)."""
    torch.manual_seed(cfg.seed + 1)
    net = nn.Sequential(
        nn.Linear(cfg.inputs, cfg.hidden),
        nn.GELU(),
        nn.Linear(cfg.hidden, cfg.hidden),
        nn.GELU(),
        nn.Linear(cfg.hidden, cfg.classes),
    )
    if cfg.pad_mib > 0:
        net.register_buffer("pad", padding(cfg, net))
    return net


def padding(cfg: TaskConfig, net: nn.Module) -> torch.Tensor:
    """The ``pad`` buffer that makes ``net``'s checkpointed state about ``cfg.pad_mib`` MiB: the
    requested size less the parameters and AdamW's two moments of each (int32 zeros, empty
    when those alone are larger). Zeros cost no time to build (the pages are mapped when first
    written, as a restore does), so a round's set-up stays the small model's; saving, copying,
    hashing and sending them cost what any bytes do."""
    trained = sum(p.numel() * p.element_size() for p in net.parameters())
    words = max(0, (cfg.pad_mib << 20) - 3 * trained) // 4
    return torch.zeros(words, dtype=torch.int32)


def make_optimizer(model: nn.Module, cfg: TaskConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)


def warm_up(cfg: TaskConfig) -> None:
    """One training step on a throwaway model and optimizer, to import what a step needs.

    The first ``optimizer.step()`` of a process imports ``torch._dynamo`` and hundreds of
    modules (seconds on a loaded machine). A spare doing that in its first round holds the
    other ranks past a short soft timeout, and the round's abort then waits for the import.
    Done before the first round instead; touches no random state.
    """
    holder = nn.Module()
    holder.w = nn.Parameter(torch.zeros(4))
    opt = make_optimizer(holder, cfg)
    loss = nn.functional.cross_entropy(
        torch.outer(holder.w, torch.ones(cfg.classes)), torch.zeros(4, dtype=torch.long)
    )
    loss.backward()
    opt.step()
    opt.zero_grad()


def batch(
    cfg: TaskConfig, teacher: nn.Module, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` for data shard ``rank``: a pure function of (seed, step, rank)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(cfg.batch, cfg.inputs, generator=gen)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    return x, y


def learning_rate(cfg: TaskConfig, step: int, steps: int) -> float:
    """Cosine decay from ``cfg.lr`` to 5 % of it over ``steps``: a pure function of the step."""
    frac = min(max(step / max(steps - 1, 1), 0.0), 1.0)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    world_size: int,
    lr: float | None = None,
    update: contextlib.AbstractContextManager[Any] | None = None,
) -> float:
    """One data-parallel step: local gradients, one flat all_reduce, averaged update.

    ``lr`` (if given) is set on every parameter group first; ``update`` (if given) is entered
    around ``optimizer.step()`` (``LiveState.update(step)``: it marks the update). Returns the
    global mean loss (all-reduced together with the gradients).
    """
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    if world_size > 1:
        dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
    with update if update is not None else contextlib.nullcontext():
        optimizer.step()
    return float(flat[-1])


def parameters_digest(model: nn.Module) -> str:
    """A hex digest of every parameter's exact bytes, for the bit-identical check."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, next_step: int
) -> dict[str, Any]:
    """What a checkpoint of the demo holds: enough to resume bit-identically at ``next_step``."""
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "step": next_step,
        "rng": torch.get_rng_state(),
    }


def reference_run(
    *,
    process: int,
    ranks: int,
    steps: int,
    port: int,
    after_step: Callable[[int, nn.Module], None] | None = None,
) -> str:
    """The fault-free run of ``steps`` steps as rank ``process`` of ``ranks`` (plain gloo on
    127.0.0.1:``port``); ``after_step(done, model)`` runs after each step. Returns the
    parameters' digest. Every rank of the reference calls it, at the same time."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=process,
        world_size=ranks,
        timeout=timedelta(seconds=120),
    )
    try:
        task = TaskConfig()
        teacher, net = make_teacher(task), make_model(task)
        opt = make_optimizer(net, task)
        for step in range(steps):
            x, y = batch(task, teacher, step, process)
            train_step(net, opt, x, y, ranks, learning_rate(task, step, steps))
            if after_step is not None:
                after_step(step + 1, net)
        return parameters_digest(net)
    finally:
        dist.destroy_process_group()
