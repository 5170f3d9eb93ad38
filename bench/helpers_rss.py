"""Helper processes per node: how many, their memory (RSS) and their start-up CPU.

For 1, 4 and 8 local ranks, each rank a real process that starts its helper the way the
wrapper does against one real TCPStore (libuv), side by side in one run:

- ``before``: a sidecar process per rank as of the baseline commit (default 5e60a79: each one
  imports torch to talk to the store), extracted from git into a temporary directory (its
  ``Sidecar`` handle);
- ``node``: this tree: one node watcher for the node's ranks
  (:class:`trainguard.restart._helper.HelperHandle`), the only helper outside ``trainguard
  launch`` (the per-rank sidecar process was removed in issue 42).

Measured once every rank is watched and the helpers ran 1 s (heartbeats on): distinct helper
processes, the sum of their VmRSS, and the sum of their CPU time (user + system) since start,
with that of the node watcher's starter process (it imports, forks the watcher and exits).
Target (issue 16): <= 1 helper and <= 100 MB of helper RSS per node at 8 local ranks.

Run: ``.venv/bin/python bench/helpers_rss.py [--baseline COMMIT]`` (about 1-2 minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import print_table, write_results  # noqa: E402

LOCAL_RANKS = (1, 4, 8)
SETTLE_S = 1.0  # seconds the helpers run (beating) before they are measured

# One rank: start its helper (the wrapper's handle), print the helper's pid, wait for stdin.
RANK = r"""
import resource, sys
from trainguard.coord.keys import Keyspace
from trainguard.restart.config import WrapperConfig
from trainguard.restart import sidecar as sc
rank, world, port, job, node = sys.argv[1:6]
if node == "1":
    from trainguard.restart._helper import HelperHandle, Transport
cfg = WrapperConfig(soft_timeout=300, hard_timeout=600, heartbeat_interval=0.2,
                    heartbeat_timeout=60)
config = sc.SidecarConfig.build(cfg, rank=int(rank), world=int(world),
                                keys=Keyspace(job, 0, "b" * 32),
                                addr=("127.0.0.1", int(port)), log_dir=None)
if node == "1":
    handle = HelperHandle(config, Transport.node_watcher(config))
else:
    handle = sc.Sidecar(config)
handle.start()
handle.handshake(120)
handle.send({"round": 0, "roster": list(range(int(world)))})
pid = handle.watcher_pid if node == "1" else handle.proc.pid
kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # a reaped starter of the node watcher
print(pid, kids.ru_utime + kids.ru_stime, flush=True)
sys.stdin.read()
handle.stop(30)
"""


def _proc_stat(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds user + system) of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def measure(src: Path, port: int, k: int, job: str, *, node: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(k), str(port), job, "1" if node else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for r in range(k)
    ]
    try:
        lines = [p.stdout.readline().split() for p in ranks if p.stdout is not None]
        ready = time.monotonic() - start
        pids = [int(line[0]) for line in lines]
        reaped = sum(float(line[1]) for line in lines)
        time.sleep(SETTLE_S)
        helpers = sorted(set(pids))
        stats = [_proc_stat(pid) for pid in helpers]
    finally:
        for p in ranks:
            if p.stdin is not None:
                p.stdin.close()
        for p in ranks:
            p.wait(60)
            if p.stdout is not None:
                p.stdout.close()
    return {
        "local_ranks": k,
        "helpers": len(helpers),
        "rss_mb": sum(s[0] for s in stats),
        "cpu_s": sum(s[1] for s in stats) + reaped,
        "all_watched_s": ready,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="5e60a79", help="commit of the 'before' sidecars")
    args = parser.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"load_before": os.getloadavg(), "baseline": args.baseline}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "src"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        variants = {
            f"before ({args.baseline})": (Path(tmp) / "src", False),
            "node": (ROOT / "src", True),
        }
        for name, (src, node) in variants.items():
            results[name] = []
            for k in LOCAL_RANKS:
                job = f"bench-{name.split()[0]}-{k}"
                row = measure(src, store.port, k, job, node=node)
                results[name].append(row)
                rows.append([name, k, row["helpers"], row["rss_mb"], row["cpu_s"],
                             row["all_watched_s"]])  # fmt: skip
    results["load_after"] = os.getloadavg()
    print_table(
        f"helper processes per node (load {results['load_before'][0]:.1f} before, "
        f"{results['load_after'][0]:.1f} after)",
        ["variant", "local ranks", "helpers", "RSS MB", "CPU s", "all watched s"],
        rows,
    )
    write_results("helpers_rss", results)
    del store


if __name__ == "__main__":
    main()
