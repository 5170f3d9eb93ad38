"""Fixtures for checkpoint tests: states, a size-limited or read-only file system, leak checks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def sample_state(seed: int = 0) -> dict:
    """A nested state with every kind of leaf the format must carry bit-exactly."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 6, generator=g)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 6, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "tensors": {
            "f64": torch.randn(3, generator=g, dtype=torch.float64),
            "f16": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(7, generator=g).bfloat16(),
            "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
            "i64": torch.randint(-(2**62), 2**62, (4,), generator=g, dtype=torch.int64),
            "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
            "bool": torch.rand(11, generator=g) > 0.5,
            "c64": torch.randn(4, generator=g, dtype=torch.complex64),
            "c128": torch.randn(2, 2, generator=g, dtype=torch.complex128),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 4),
            "noncontig": torch.randn(6, 8, generator=g).t()[::2],
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "views": {"w": w, "wt": w.t(), "row": w[3], "bytes": w.view(torch.int32)[1:3]},
        "plain": {
            "int": 7,
            "big": 2**70,
            "float": 0.1,
            "nan": float("nan"),
            "str": "step ✓",
            "none": None,
            "list": [1, [2.5, "x"], None],
            "tuple": (1, (2, 3)),
            "bool": True,
            "bytes": b"\x00\xff",
            "dtype": torch.bfloat16,
            "int_keys": {0: "a", 1: "b", "2": "c"},
        },
        "rng": torch.get_rng_state(),
    }


def assert_same(a, b, path="state") -> None:
    """Bit-exact equality of nested states (tensor bytes, dtype, shape; NaN equals NaN)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        ac, bc = a.contiguous(), b.contiguous()
        if a.numel():
            assert torch.equal(
                ac.view(torch.uint8) if ac.dim() else ac.reshape(1).view(torch.uint8),
                bc.view(torch.uint8) if bc.dim() else bc.reshape(1).view(torch.uint8),
            ), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def snapshot() -> dict:
    """What a checkpointer could leak: threads, child processes, memfds, file descriptors."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                if int(fields[1]) == me and fields[0] != "Z":
                    children.append(int(entry))
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    maps = Path("/proc/self/maps").read_text()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "children": sorted(set(children) - {_resource_tracker_pid()}),
        "memfds": sorted(v for v in fds.values() if "trainguard" in v),
        "mapped": maps.count("trainguard-staging"),
        "fds": len(fds),
    }


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves threads, processes, shared memory or fds behind."""
    from trainguard.checkpoint.writer import WriterProcess

    # The first spawn starts multiprocessing's shared resource tracker (one per interpreter,
    # not ours): start it before the baseline.
    w = WriterProcess()
    w.start()
    w.stop()
    import gc

    gc.collect()
    before = snapshot()
    yield
    gc.collect()
    after = snapshot()
    assert after["threads"] == before["threads"]
    assert after["children"] == before["children"]
    assert after["memfds"] == [] and after["mapped"] == 0, after
    assert after["fds"] <= before["fds"], (before, after)


def _mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    return out.returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test: writing more than that fails with a real ENOSPC."""
    mnt = tmp_path / "small"
    if not _mount(mnt, "size=1m"):
        pytest.skip("needs root to mount a 1 MiB tmpfs (mount -t tmpfs -o size=1m)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory the process cannot write to (a read-only tmpfs as root; chmod 555 otherwise,
    since root ignores permission bits)."""
    mnt = tmp_path / "ro"
    if _mount(mnt, "size=1m,ro"):
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    else:
        mnt.chmod(0o555)
        yield mnt
        mnt.chmod(0o755)
