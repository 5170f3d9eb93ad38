"""One rank of a local-checkpoint job on an emulated host (run as a script by
``test_local_ckpt_hosts.py``): ``save`` saves iterations 1 and 2 and waits for every copy;
``load`` resumes from the newest iteration every part of which some rank holds. It reports its
host name, clique and what it loaded as JSON to ``out``.

    _ckpt_worker.py save|load RANK WORLD STORE_HOST PORT ROOT OUT
"""

from __future__ import annotations

import json
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager


def state(owner: int, iteration: int) -> dict:
    g = torch.Generator().manual_seed(owner * 100 + iteration)
    return {"w": torch.randn(256, 64, generator=g), "owner": owner, "iteration": iteration}


def main() -> None:
    phase, rank, world, store_host, port, root, out = sys.argv[1:]
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{store_host}:{port}",
        rank=rank_i,
        world_size=world_i,
        timeout=timedelta(seconds=60),
    )
    report: dict = {"host": socket.gethostname()}
    with LocalCheckpointManager(root, replication=CliqueReplication(2), timeout=60) as mgr:
        report["clique"] = mgr.clique
        if phase == "save":
            for it in (1, 2):
                mgr.save(state(rank_i, it), it)
            mgr.wait()
        else:
            found = mgr.find_latest()
            report["found"] = found
            if found is not None:
                got = mgr.load(found)
                report["equal"] = bool(torch.equal(got["w"], state(rank_i, found)["w"]))
                report["source"] = (mgr.last_load or {}).get("source")
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
