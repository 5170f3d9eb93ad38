"""A staging buffer that cannot be reserved is a clear CheckpointError from save(), under real
limits set in a child process (address space, file size, a state larger than the machine's
memory), never a RuntimeError from deep inside torch, a SIGBUS or an OOM kill."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from trainguard.checkpoint import AsyncCheckpointer, load
    from trainguard.errors import CheckpointError

    kind, out = sys.argv[1], sys.argv[2]
    state = {"w": torch.ones(256 << 20, dtype=torch.uint8)}  # a 256 MiB buffer is needed
    ckpt = AsyncCheckpointer(staging_threads=1)
    limit = {"as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE}.get(kind)
    if limit is not None:
        soft, hard = resource.getrlimit(limit)
        if kind == "as":
            vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
            resource.setrlimit(limit, (vm + (64 << 20), hard))
        else:
            resource.setrlimit(limit, (64 << 20, hard))
    else:  # a view of 1 byte that stands for more bytes than the machine has
        state = {"w": torch.ones(1, dtype=torch.uint8).expand(1 << 50)}
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 49, resource.RLIM_INFINITY))  # safety
    result = {}
    try:
        ckpt.save(state, out + "/refused")
        result["error"] = None
    except CheckpointError as exc:
        result["error"] = str(exc)
    except BaseException as exc:
        result["other"] = f"{type(exc).__name__}: {exc}"
    if limit is not None:
        resource.setrlimit(limit, (soft, hard))
    small = {"w": torch.arange(10.0)}
    ckpt.save(small, out + "/after")  # the checkpointer still works
    ckpt.close()
    result["after"] = torch.equal(load(out + "/after")["w"], small["w"])
    print(json.dumps(result))
    """
)


@pytest.mark.parametrize("kind", ["as", "fsize", "memory"])
def test_an_unreservable_staging_buffer_is_a_checkpoint_error(tmp_path: Path, kind: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "other" not in result, result
    error = result["error"]
    assert error is not None and "staging buffer" in error, result
    assert "raise the limit" in error or "free memory" in error, error
    assert result["after"] is True
    assert not (tmp_path / "refused").exists()
