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

Sharded rows (``--sharded MIB``, issue 39): FSDP2 (1-D mesh of 4 ranks + 1 spare) and HSDP
(2 x 2 mesh + 1 spare), MIB MiB of state per rank, real ``fully_shard`` on CPU/gloo
(``bench/_sharded_job.py``). Per mesh, two runs with the same faults (an exception in backward,
a hang, a torn ``optimizer.step()``, a kill with a spare): one with ``LiveState`` (the lost or
torn rank's shards from a rank holding the same shards; a fallback to the newest checkpoint
where none does), one restoring the newest ``torch.distributed.checkpoint`` checkpoint (saved
every 5 steps in both runs). Per fault: steps recomputed, fault -> every rank finished its
first step again (a hang's minus its soft timeout), what the state came from; the final local
shards of both runs compared per rank. The killed rank's transfer is timed against a plain
``dist.send`` of the same bytes between the same two ranks on the same group, in the same run.
FSDP2 1-D also runs a third time with peer snapshots (``LiveState(snapshot_every=1)``,
issue 39 item 2): the torn and killed ranks' shards come from snapshots (at most 1 step
recomputed) instead of the checkpoint; its fault-free steps before the first fault are timed
against the same steps of the run without snapshots (same invocation, same machine).

Run: ``.venv/bin/python bench/zero_loss.py [--models 0 256] [--ranks 4] [--big-ranks 2]``;
sharded rows only: ``.venv/bin/python bench/zero_loss.py --models --sharded 16`` (written to
bench/results/zero_loss_sharded_16mib.json).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks

from bench import _recovery_job, _sharded_job
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


SHARDED_FAULTS = [("exception", 2, 7), ("hang", 1, 13), ("torn", 1, 18), ("kill", 3, 26)]
SHARDED_STEPS, CKPT_EVERY, SOFT = 30, 5, 10.0


def sharded_run(
    mesh: tuple[int, ...], mib: int, live: bool, out: Path, snapshot_every: int | None = None
) -> dict[str, Any]:
    """One sharded job (4 ranks + 1 spare): per fault its round's records; final digests;
    the fault-free steps' seconds of every rank before the first fault."""
    out.mkdir(parents=True)
    args = (SHARDED_STEPS, 4, mesh, SHARDED_FAULTS, str(out), mib, live, CKPT_EVERY, SOFT)
    args += (snapshot_every,)
    results = run_ranks(_sharded_job.job, 5, args=args, timeout=560)
    values = [r.get() for r in results if r.exitcode != -9]  # the killed rank returns nothing
    lines = (out / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    step_s = [t for r in records for t in r.get("step_s", [])]
    snaps = [r for r in records if r.get("snapshots")]  # per rank: its snapshots' totals
    per = {
        k: sum(r[k] for r in snaps) / max(1, sum(r["snapshots"] for r in snaps))
        for k in ("copy_s", "transfer_s", "waited_s")
    }
    records = [r for r in records if "step_s" not in r]
    sent = {r["round"]: r["plain_send_s"] for r in records if "plain_send_s" in r}
    for r in records:
        if r.get("receivers") and r.get("received_from") is not None and r["round"] in sent:
            r["plain_send_s"] = sent[r["round"]]
    faults = []
    for i, (kind, _, _) in enumerate(SHARDED_FAULTS):
        round_ = int((out / f"fault-{i}").read_text()) + 1
        recs = [rec for rec in records if rec["round"] == round_ and "rank" in rec]
        again = max(rec["first_step_done"] for rec in recs) - float((out / f"t-{i}").read_text())
        faults.append({"kind": kind, "round": round_, "again_s": again, "records": recs})
    digests = {v["rank"]: v["digest"] for v in values}
    return {"faults": faults, "digests": digests, "step_s": step_s, "per_snapshot": per}


def sharded_rows(name: str, path: str, run: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for f in run["faults"]:
        recs = f["records"]
        again = f["again_s"] - (SOFT if f["kind"] == "hang" else 0.0)
        if path == "checkpoint":
            how, source = "checkpoint", f"dcp, step {recs[0]['first']}"
        elif all(r["live"] for r in recs):
            got = sorted(r["rank"] for r in recs if r.get("received_from") is not None)
            how, source = "live", f"peers -> {got}" if got else "own shards"
            if any(r.get("snapshot") for r in recs):
                how, source = "live: peer snapshots", f"snapshots, buddy -> {got}"
        else:
            reason = next(r["fallback"] for r in recs if r.get("fallback"))
            reason = re.sub(r" \d{4,}", "", reason).split(" (")[0]
            how, source = f"fallback: {reason}", f"dcp, step {recs[0]['first']}"
        rows.append([name, f["kind"], how, recs[0]["recomputed"], again * 1e3, source])
    return rows


def sharded(mib: int, tmp: Path, results: dict[str, Any]) -> tuple[list[Any], list[Any], list[Any]]:
    rows: list[list[Any]] = []
    transfer_rows: list[list[Any]] = []
    cost_rows: list[list[Any]] = []
    for mesh, name in (((4,), "FSDP2 1-D 4+1"), ((2, 2), "HSDP 2x2+1")):
        runs = {}
        paths = ("live", "snapshots", "checkpoint") if len(mesh) == 1 else ("live", "checkpoint")
        for path in paths:
            print(f"{name}, {mib} MiB/rank: {path} ...", flush=True)
            every = 1 if path == "snapshots" else None
            runs[path] = sharded_run(mesh, mib, path != "checkpoint", tmp / f"{name}-{path}", every)
            results["sharded"][f"{name}/{path}"] = runs[path]
        same = all(runs[p]["digests"] == runs["checkpoint"]["digests"] for p in paths)
        results["sharded"][f"{name}/identical"] = same
        for path in paths:
            label = f"{path} (snapshot_every=1)" if path == "snapshots" else path
            rows += [[*r, "yes" if same else "NO"] for r in sharded_rows(name, label, runs[path])]
        if "snapshots" in runs:
            base = percentile(runs["live"]["step_s"], 50)
            with_ = percentile(runs["snapshots"]["step_s"], 50)
            added = (with_ - base) / base * 100 if base > 0 else float("nan")
            per = runs["snapshots"]["per_snapshot"]
            met = "yes" if added <= 5 else "no"
            parts = [per["copy_s"] * 1e3, per["transfer_s"] * 1e3, per["waited_s"] * 1e3]
            cost_rows.append([name, mib, base * 1e3, with_ * 1e3, added, "<=5", met, *parts])
            results["snapshot_cost"] = {"step_s": base, "step_s_snapshots": with_, "added": added}
        sent = [
            r
            for f in runs["live"]["faults"]
            for r in f["records"]
            if f["kind"] == "kill" and "plain_send_s" in r
        ]
        for r in sent:
            ratio = r["transfer_s"] / r["plain_send_s"] if r["plain_send_s"] > 0 else float("nan")
            ok = "yes" if ratio <= RATIO else "no"
            mb, ms, base = r["nbytes"] / 2**20, r["transfer_s"] * 1e3, r["plain_send_s"] * 1e3
            transfer_rows.append([name, mb, ms, base, ratio, f"<={RATIO}", ok])
            results["transfer"][f"{name} kill"] = {"bytes": r["nbytes"], "ratio": ratio}
    return rows, transfer_rows, cost_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="*", default=[0, 256], help="MiB per rank")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--big-ranks", type=int, default=4, help="ranks for --models N>0")
    parser.add_argument(
        "--sharded",
        type=int,
        metavar="MIB",
        help="add FSDP2 and HSDP rows, MIB MiB of state per rank",
    )
    args = parser.parse_args()
    results: dict[str, Any] = {"runs": {}, "transfer": {}, "sharded": {}}
    rows: list[list[Any]] = []
    transfer_rows: list[list[Any]] = []
    more: list[list[Any]] = []
    cost: list[list[Any]] = []
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
        if args.sharded:
            more, moved_rows, cost = sharded(args.sharded, Path(tmp), results)
            transfer_rows += moved_rows
    if args.sharded:
        print_table(
            f"sharded ({args.sharded} MiB of state per rank): live state vs the dcp checkpoint",
            ["model", "fault", "recovery", "recomputed", "training again ms", "from", "identical"],
            more,
        )
        print_table(
            "peer snapshots every step: median fault-free step, same invocation",
            [
                *("model", "MiB/rank", "step ms", "with snapshots ms", "added %", "target"),
                *("met", "copy ms", "transfer ms", "update waited ms"),
            ],
            cost,
        )
    if rows:
        print_table(
            "steps recomputed and fault -> training again, per fault",
            ["model", "fault", "recovery", "recomputed", "training again ms", "loaded from"],
            rows,
        )
    print_table(
        "a spare receiving a replica's state (live) vs a plain gloo send of those bytes",
        ["model", "MiB", "live transfer ms", "gloo send ms", "ratio", "target", "met"],
        transfer_rows,
    )
    # sharded rows alone (``--models`` with no size) keep the demo rows' file as it is
    write_results("zero_loss" if args.models else f"zero_loss_sharded_{args.sharded}mib", results)


if __name__ == "__main__":
    main()
