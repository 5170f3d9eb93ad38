"""One rank of a wrapped job on an emulated host, for the quarantine tests: 3 ranks. ``flaky``:
2 active, the rank on the second host raises whenever it is active; ``software``: all 3
active, every rank raises the same error at the same place, every round (a bug, no host's);
``software-skewed``: the same, but the ranks of the other hosts raise it 3 s after the first
host's, so that its fault's abort interrupts them first while it takes part.

Run as ``python tests/cluster/_quarantine_rank.py OUT_DIR [flaky|software]`` with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; writes ``OUT_DIR/result-<rank>.json``
(the rounds its function ran in, its last value or the error that ended the job). The host
name is the host's own (``socket.gethostname()``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main(out_dir: str, mode: str = "flaky") -> None:
    import socket

    import torch
    import torch.distributed as dist

    import trainguard.restart as tr
    from trainguard.errors import RetryLimitError

    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    rounds: list[int] = []

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(2 if mode == "flaky" else 3),
        max_repeated_faults=4 if mode == "software-skewed" else 3,
        quarantine=tr.Quarantine(after=2, probes=[], file=out / "exclude"),
        barrier_timeout=60,
        store_timeout=20,
    )
    def train(call: tr.CallWrapper) -> dict[str, Any]:
        rounds.append(call.round)
        if mode == "flaky":
            call.ping()  # progress: the software bug makes none, so its repeats end the job
        dist.init_process_group("gloo")
        ones = torch.ones(1)
        dist.all_reduce(ones)
        if mode.startswith("software"):
            if mode == "software-skewed" and socket.gethostname() != "h1":
                time.sleep(3.0)  # interrupted here by h1's fault while h1 takes part
            raise ValueError("index out of range in the data loader")
        if socket.gethostname() == "h2":
            raise OSError("the NIC dropped the link")
        return {"round": call.round, "rank": call.rank, "sum": int(ones.item())}

    result: dict[str, Any] = {"rounds": rounds}
    try:
        result["value"] = train()
    except RetryLimitError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    out.joinpath(f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
