"""Local checkpoints with replication: 4 ranks lose one "node"'s storage and lose nothing.

Run: ``.venv/bin/python examples/local_checkpoint.py [--root DIR]``. It starts 4 ranks itself
(gloo on CPU), as 2 "nodes" of 2 ranks (each rank names its node in TRAINGUARD_HOST_NAME), so
``CliqueReplication(factor=2)``, which places copies by host, keeps each rank's part on its own
root and on a rank of the other node. The first run trains
and checkpoints every 5 steps; then rank 1's root is deleted; the second run finds the newest
iteration, rank 1 receives its part from rank 3, and every rank resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import shutil
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

WORLD = 4


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for t in model.state_dict().values():
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def rank_main(rank: int, port: int, root: str, steps: int, conn) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TRAINGUARD_HOST_NAME=f"node{rank // 2}",  # 2 emulated nodes on this machine
    )  # fmt: skip
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first, report = 0, {}
    # every rank creates the manager, calls find_latest, load, save, close together
    with LocalCheckpointManager(
        f"{root}/rank{rank}", replication=CliqueReplication(factor=2), keep=2
    ) as mgr:
        latest = mgr.find_latest()
        if latest is not None:
            state = mgr.load(latest)  # this rank's part, from a peer if its own is gone
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            first = state["step"] + 1
            report["resumed"] = (latest, digest(model))
        for step in range(first, steps):
            x = torch.randn(16, 32)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 5 == 4:
                state = {
                    "model": model.state_dict(),
                    "optim": optimizer.state_dict(),
                    "step": step,
                    "rng": torch.get_rng_state(),
                }
                mgr.save(state, step)  # returns after the copy to shared memory
                report[step] = digest(model)
        mgr.wait()  # every part and every copy durable, on every rank
    dist.destroy_process_group()
    conn.send(report)


def run(root: str, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for rank in range(WORLD):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=rank_main, args=(rank, port, root, steps, send))
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    reports = [p.recv() for p in pipes]
    for proc in procs:
        proc.join()
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", help="directory for the ranks' roots (default: a temp dir)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="trainguard-local-")
    first = run(root, steps=20)
    print("first run saved iterations", sorted(k for k in first[0] if isinstance(k, int)))
    print(f"kept on rank 0: {sorted(os.listdir(f'{root}/rank0'))}")
    shutil.rmtree(f"{root}/rank1")  # rank 1's node is lost, with its storage
    print("deleted rank 1's root")
    second = run(root, steps=25)
    ok = True
    for rank, report in enumerate(second):
        it, got = report["resumed"]
        ok &= it == 19 and got == first[rank][19]
        print(f"rank {rank}: resumed at iteration {it}, model {got} (saved {first[rank][19]})")
    print(f"every rank resumed bit-exact: {ok}")
    if not args.root:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
