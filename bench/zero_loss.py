"""Zero lost steps: live-state recovery against today's checkpoint path, on the demo.

For each model size, two ``trainguard demo`` runs with the same schedule (an exception, a hang
and a kill, each once, on different ranks; 4 ranks + 1 spare by default): one recovering from
live state (the default), one with ``--no-live`` (the newest local checkpoint, as before
:mod:`trainguard.live`). From each run's ``report.json``, per fault: the steps recomputed and
the time from the fault to training again (every active rank finished a step of the new
round; a hang's is shown minus its soft timeout).

The transfer: in the live runs, the spare that takes over the killed rank receives the whole
state from a replica; its ``live_recover`` event gives the seconds of its transfer passes
(the donor's flattening and checksums, the messages, the receiver's checksums and load, the
pass's closing all-reduce) and the bytes. The baseline is a plain gloo
send of the same number of bytes between two processes (median of 3), measured in the same
run. Target (issue 33): recovery no slower than the checkpoint path, except the transfer of
one replica's state, at most 1.2x the plain send.

Run: ``.venv/bin/python bench/zero_loss.py [--models 0 256] [--ranks 4] [--big-ranks 2]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks

from bench import _recovery_job
from bench._common import percentile, print_table, write_results
from trainguard import events

RATIO = 1.2  # the live transfer against a plain gloo send of the same bytes


def shape(mib: int, ranks: int) -> dict[str, Any]:
    """Steps, schedule and timings of one run (a larger state needs longer steps and a
    longer soft timeout on a loaded 2-core machine)."""
    if mib == 0:
        every, local_every, soft, step_time = 23, 10, 3.0, 0.0
    else:
        every, local_every, soft, step_time = 25, 20, 15.0, 0.3
    kinds = ("exception", "hang", "kill")
    faults = [f"{k}@{every * (i + 1)}:{1 + i % (ranks - 1)}" for i, k in enumerate(kinds)]
    return {
        "faults": ",".join(faults),
        "steps": every * (len(kinds) + 1),
        "local_every": local_every,
        "soft_timeout": soft,
        "step_time": step_time,
    }


def demo(mib: int, ranks: int, live: bool, out: Path) -> dict[str, Any]:
    """One demo run: each fault's report entry and the live transfers of the run."""
    s = shape(mib, ranks)
    cmd = [sys.executable, "-m", "trainguard", "demo", "--ranks", str(ranks), "--spares", "1"]
    cmd += ["--steps", str(s["steps"]), "--faults", s["faults"], "--out", str(out)]
    cmd += ["--local-every", str(s["local_every"]), "--disk-every", "1000"]
    cmd += ["--soft-timeout", str(s["soft_timeout"]), "--step-time", str(s["step_time"])]
    cmd += ["--model-mib", str(mib), "--timeout", "500"]
    cmd += [] if live else ["--no-live"]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=560).returncode
    if code != 0:
        raise RuntimeError(f"demo failed ({code}), see {log}:\n{log.read_text()[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    found = events.read_events(out / "events")
    transfers = [
        (float(e["transfer"]), int(e["nbytes"]))
        for e in found
        if e.get("kind") == "live_recover" and int(e.get("nbytes") or 0) > 0
    ]
    return {"faults": report["faults"], "soft_timeout": s["soft_timeout"], "transfers": transfers}


def plain_send(nbytes: int) -> float:
    """Seconds of a plain gloo send of ``nbytes`` between two processes (median of 3)."""
    results = run_ranks(_recovery_job.send_part, 2, args=(nbytes, 3), timeout=300)
    return percentile([v for r in results for v in r.get()], 50)


def rows_of(model: str, path: str, run: dict[str, Any]) -> list[list[Any]]:
    out = []
    for f in run["faults"]:
        if not f.get("injected"):  # a round restarted by a stall nobody injected
            out.append(
                [model, f"({f['kind']}, not injected)", path, f["recomputed_steps"], "-", ""]
            )
            continue
        again = f.get("training_again")
        if again is not None and f["kind"] == "hang":
            again -= run["soft_timeout"]
        ms = again * 1e3 if again is not None else "-"
        out.append([model, f["kind"], path, f["recomputed_steps"], ms, f.get("load_source", "")])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="+", default=[0, 256], help="MiB per rank")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--big-ranks", type=int, default=4, help="ranks for --models N>0")
    args = parser.parse_args()
    results: dict[str, Any] = {"runs": {}, "transfer": {}}
    rows: list[list[Any]] = []
    transfer_rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory(prefix="tg-zero-loss-") as tmp:
        for mib in args.models:
            ranks = args.big_ranks if mib else args.ranks
            model = f"{mib} MiB x {ranks}" if mib else f"demo x {ranks}"
            for live in (True, False):
                path = "live" if live else "checkpoint"
                print(f"{model}: {path} ...", flush=True)
                run = demo(mib, ranks, live, Path(tmp) / f"{mib}-{path}")
                results["runs"][f"{model}/{path}"] = run
                rows += rows_of(model, path, run)
            moved = results["runs"][f"{model}/live"]["transfers"]
            if moved:
                seconds, nbytes = max(moved, key=lambda t: t[1])
                base = plain_send(nbytes)
                ratio = seconds / base if base > 0 else float("nan")
                results["transfer"][model] = {
                    "bytes": nbytes,
                    "live_transfer_s": seconds,
                    "gloo_send_s": base,
                    "ratio": ratio,
                }
                ok = "yes" if ratio <= RATIO else "no"
                transfer_rows.append(
                    [model, nbytes / 2**20, seconds * 1e3, base * 1e3, ratio, f"<={RATIO}", ok]
                )
    print_table(
        "steps recomputed and fault -> training again, per fault",
        ["model", "fault", "recovery", "recomputed", "training again ms", "loaded from"],
        rows,
    )
    print_table(
        "a spare receiving a replica's whole state (live) vs a plain gloo send of those bytes",
        ["model", "MiB", "live transfer ms", "gloo send ms", "ratio", "target", "met"],
        transfer_rows,
    )
    write_results("zero_loss", results)


if __name__ == "__main__":
    main()
