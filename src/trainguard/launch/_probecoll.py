"""The device probe of a quarantined node: in each of ``N`` processes of the node (one per
worker), a small matrix product on its device checked against its known result
(:class:`~trainguard.restart.probes.MatmulProbe`, ``LOCAL_RANK`` = its index), then a gloo
all-reduce among them whose sum is known (each adds its rank + 1: ``N (N + 1) / 2``).

Run by the node's agent (:mod:`trainguard.launch._quarantine`) as ``python -m
trainguard.launch._probecoll N``: it starts ``N`` processes (``... N RANK PORT``) on a free
loopback port and exits 0 when each of them did, else 1. The agent bounds the whole in time
and kills its process group past the bound (a hang is a failed probe).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta


def _member(n: int, rank: int, port: int) -> int:
    import os

    import torch
    import torch.distributed as dist

    from trainguard.restart.probes import MatmulProbe

    os.environ["LOCAL_RANK"] = str(rank)
    MatmulProbe(64)()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=60),
    )
    try:
        value = torch.full((16,), float(rank + 1))
        dist.all_reduce(value)
        want = n * (n + 1) / 2
        if not bool((value == want).all()):
            print(f"all-reduce sum {value.tolist()[:3]}..., expected {want}", file=sys.stderr)
            return 1
        return 0
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    n = int(argv[0])
    if len(argv) == 3:
        return _member(n, int(argv[1]), int(argv[2]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    module = [sys.executable, "-m", "trainguard.launch._probecoll", str(n)]
    procs = [subprocess.Popen([*module, str(r), str(port)]) for r in range(n)]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"the node's all-reduce failed: exit statuses {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
