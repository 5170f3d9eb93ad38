"""Live-state transfer (:mod:`trainguard.live._transfer`) against a plain gloo send.

Two gloo ranks on this machine. Rank 0 holds a state of ``--mib`` MiB: one large tensor, as the
demo's ``--model-mib`` pad, plus 20 small ones that travel in the pack. Rank 1 receives it
into its own tensors of the same shapes, in place, as a spare or a torn rank does. Each
repetition times three things back to back, each from a barrier to a barrier:

- ``plain``: one ``dist.send``/``dist.recv`` of the large tensor's bytes. This is the baseline
  that issue 33's target names.
- ``live``: ``prepare`` + ``send`` on the donor; ``receive`` (checksums included) and the
  ``copy_`` that loading does on the receiver.
- ``live, no checksums``: the same with the checksum function replaced by a constant. It is a
  diagnostic of what checksumming costs on this machine; the library always checksums.

It reports the median of each, and the ratios to ``plain``. The target (issue 33) is a
transfer of one replica's state of at most 1.2 times a plain send of those bytes.

Run: ``.venv/bin/python bench/live_transfer.py [--mib 256] [--repeats 25]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks

from bench._common import print_table, write_results

RATIO = 1.2
KINDS = ("plain", "live", "live, no checksums")


def _job(mib: int, repeats: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from trainguard.live import _transfer

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        state = {
            "pad": torch.full(((mib << 20) // 4,), float(rank)),
            "small": [torch.full((100,), float(rank + i)) for i in range(20)],
        }
        recv_buf = torch.ones(mib << 20, dtype=torch.uint8)
        real_digest = _transfer._digest
        took: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(repeats):
            for kind in KINDS:
                _transfer._digest = (lambda t: 0) if kind.endswith("checksums") else real_digest  # type: ignore[assignment]
                dist.barrier()
                start = time.perf_counter()
                if kind == "plain":
                    if rank == 0:
                        dist.send(state["pad"].view(torch.uint8), 1)
                    else:
                        dist.recv(recv_buf, 0)
                elif rank == 0:
                    for work in _transfer.send(_transfer.prepare(state, 1), 1):
                        work.wait()
                else:
                    got = _transfer.receive(0, 1, into=_transfer.own_bytes(state))
                    if got.problem is not None:
                        raise RuntimeError(got.problem)
                    state["pad"].copy_(got.state["pad"])
                dist.barrier()
                took[kind].append(time.perf_counter() - start)
        _transfer._digest = real_digest
        return took
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the large tensor's MiB")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    took = run_ranks(_job, 2, args=(args.mib, args.repeats), timeout=900)[1].get()
    median = {k: statistics.median(v) for k, v in took.items()}
    rows: list[list[Any]] = []
    for kind in KINDS:
        ratio = median[kind] / median["plain"]
        met = "" if kind != "live" else ("yes" if ratio <= RATIO else "no")
        rows.append([kind, median[kind] * 1e3, min(took[kind]) * 1e3, ratio, met])
    print_table(
        f"live transfer of {args.mib} MiB, 2 gloo ranks, {args.repeats} repeats (ms)",
        ["transfer", "median", "min", "x plain", f"<= {RATIO}x"],
        rows,
    )
    write_results(
        "live_transfer",
        {
            "mib": args.mib,
            "repeats": args.repeats,
            "median_s": median,
            "ratio_to_plain": {k: median[k] / median["plain"] for k in KINDS},
            "target_ratio": RATIO,
            "samples_s": took,
        },
    )


if __name__ == "__main__":
    main()
