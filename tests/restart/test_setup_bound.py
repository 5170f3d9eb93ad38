"""The parts of the bounded group construction (trainguard.restart._setup) on their own: the
members' barrier on a real TCPStore, which backends are bounded."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard import _torchcompat
from trainguard.restart import _setup


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_members_wait_for_each_other_generation_by_generation() -> None:
    server = _server()
    passed: list[tuple[str, float]] = []

    def member(name: str, delay: float) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        for _ in range(2):  # two constructions on one store: two generations
            time.sleep(delay)
            _setup._arrive(client, "g", 2, timedelta(seconds=10))
            passed.append((name, time.monotonic()))

    start = time.monotonic()
    threads = [threading.Thread(target=member, args=a) for a in (("a", 0.0), ("b", 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(n for n, _ in passed) == ["a", "a", "b", "b"]
    # the early member waited for the late one each time
    assert min(t for _, t in passed) - start >= 0.3


def test_a_member_alone_waits_the_group_timeout() -> None:
    server = _server()
    start = time.monotonic()
    with pytest.raises(Exception, match=r"[Tt]imeout|timed out"):
        _setup._arrive(server, "alone", 2, timedelta(seconds=0.5))
    assert time.monotonic() - start >= 0.4


@pytest.mark.parametrize(
    ("backend", "bounded"),
    [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("undefined", True), ("nccl", False)],
)
def test_only_a_backend_that_connects_in_its_constructor_is_bounded(
    backend: str, bounded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _torchcompat.connects_in_constructor(backend) is bounded
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # gloo's lazy mode connects later
    assert _torchcompat.connects_in_constructor(backend) is False


def test_outside_the_wrapper_nothing_is_bounded() -> None:
    assert _setup.SetupBound.connect_s() is None
    calls: list[object] = []
    assert _setup.build(lambda *a, **k: calls.append((a, k)) or "g", (1, 2), {"x": 3}) == "g"
    assert calls == [((1, 2), {"x": 3})]
