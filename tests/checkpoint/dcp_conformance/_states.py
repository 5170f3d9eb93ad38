"""States the conformance tests save: small models, optimizers and plain values."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """Linear layers of uneven sizes and an embedding bag, as DCP's own tests use."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(5, 10)
        self.l2 = nn.Linear(10, 15)
        self.l3 = nn.Linear(15, 3)
        self.emb = nn.EmbeddingBag(5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    """A net and its Adam optimizer after one step (so the optimizer has state)."""
    net = Net(seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def like(state: Any) -> Any:
    """A state of the same structure whose tensors are zeros (values that are not tensors
    stay as they are: DCP replaces them on load)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [like(v) for v in state]
    return state


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Equal structure, bit-identical tensors (dtype and shape included), equal other values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all(), where
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for key, value in want.items():
            assert_same(got[key], value, f"{where}.{key}")
        return
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
        return
    assert got == want, (where, got, want)
