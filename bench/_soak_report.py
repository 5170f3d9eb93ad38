"""The soak's verdict: every check from the run directory, then a printed summary."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench import _soak_check as check
from bench._common import print_table, summarize
from bench._soak_plan import SoakConfig
from bench._soak_run import Segment


def _job_restarts(
    segments: list[Segment],
    records: list[check.StepRecord],
    faults: list[dict[str, Any]],
    ranks: int,
) -> list[dict[str, Any]]:
    """Each job-level restart: from the end of a segment to every rank training in the next."""
    rows = []
    for prev, seg in itertools.pairwise(segments):
        by_round: dict[int, dict[int, float]] = {}
        for r in records:
            if r.segment == seg.index:
                by_round.setdefault(r.round, {}).setdefault(r.rank, r.time)
        full = [max(f.values()) for f in by_round.values() if len(f) == ranks]
        cause = [
            f["label"] for f in faults if f["segment"] == prev.index and f["time"] <= prev.ended
        ]
        rows.append(
            {
                "segment": seg.index,
                "after_fault": cause[-1] if cause else None,
                "previous_ended": prev.ended,
                "started": seg.started,
                "restart_s": (min(full) - prev.ended) if full else None,
            }
        )
    return rows


def _leaks(segments: list[Segment]) -> list[str]:
    """Processes, threads, and descriptors that pile up round after round."""
    found = []
    for seg in segments:
        if seg.leftovers:
            found.append(f"segment {seg.index}: processes left running: {seg.leftovers}")
        for p, r in sorted(seg.results.items()):
            if r.get("threads_left"):
                found.append(f"segment {seg.index} process {p}: threads {r['threads_left']}")
            if _fds_grow([c[1] for c in r.get("round_counts", [])]):
                found.append(f"segment {seg.index} process {p}: fds per round {r['round_counts']}")
    return found


FDS_PER_GROUP = 5  # one gloo group outliving its round: store connection, listener, epoll, pipes


def _fds_grow(counts: list[int]) -> bool:
    """Open descriptors pile up round after round.

    ``counts`` are taken at the entry of each round, a quiescent point: the previous round's
    groups are torn down and its checkpointers closed (``finalize``), and this round's
    function has not started. The first round is left out (it starts before any group
    exists). With 6 rounds or more, the median of the last third may exceed the median of
    the first third by at most one process group's descriptors (one group may outlive its
    round; CHANGELOG, issue 12): a leak of a group per round, or of one descriptor per round
    over the long soak's rounds, is well above that.
    """
    later = counts[1:]
    if len(later) < 6:
        return False
    third = len(later) // 3
    growth = statistics.median(later[-third:]) - statistics.median(later[:third])
    return growth > FDS_PER_GROUP


def _fds_after_return(segments: list[Segment]) -> list[str]:
    return [
        f"segment {seg.index} process {p}: {r['fds_left']}"
        for seg in segments
        for p, r in sorted(seg.results.items())
        if r.get("fds_left")
    ]


def _mix(planned: list[str], recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    mix: dict[str, dict[str, Any]] = {}
    counts = Counter(planned)
    for kind in counts:
        mine = [r for r in recs if r["kind"] == kind]
        times = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        mix[kind] = {
            "planned": counts[kind],
            "injected": sum(bool(r.get("injected")) for r in mine),
            "recovered": len(times),
            "job_restarts": sum(r["job_restart"] for r in mine),
            "recovery_s": summarize(times),
        }
    return mix


def analyze(
    cfg: SoakConfig,
    ref: dict[str, Any],
    segments: list[Segment],
    *,
    wall: float,
    disk_check: dict[str, Any],
    disk_mode: str,
    stray_tmp: list[str],
    shm_new: list[str],
) -> dict[str, Any]:
    out = Path(cfg.out)
    records = check.steps(out)
    recs = check.recoveries(check.injected(out), records, cfg.ranks)
    last = segments[-1]
    digests = {p: r["digest"] for p, r in last.results.items() if r["outcome"] == "done"}
    reference = set(ref["final"].values())
    fired = {r["label"] for r in recs if r.get("injected")}
    missing = [f.label for f in cfg.faults if f.label not in fired]
    unrecovered = [r["label"] for r in recs if r["recovery_s"] is None]
    survivors = {(last.index, p) for p in digests}
    rss = check.rss_trend(records)
    # the ranks that finished; where their last segment was too short, every rank process
    judged = [row for row in rss if (row["segment"], row["process"]) in survivors] or rss
    problems = [p for seg in segments for p in seg.unexpected()]
    checks = {
        "finished": len(digests) == cfg.ranks,
        "bit_identical": len(reference) == 1 and set(digests.values()) == reference,
        "checkpoints_verify": bool(disk_check["committed"]) and not disk_check["problems"],
        "nothing_left": not _leaks(segments) and not shm_new,
        "no_fds_after_return": not _fds_after_return(segments),
        "all_injected": not missing,
        "all_recovered": not unrecovered and bool(recs),
        "rss_flat": all(check.rss_flat(row) for row in judged),
        "no_unexpected_errors": not problems,
    }
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "faults"},
        "schedule": [f.label for f in cfg.faults],
        "disk_mode": disk_mode,
        "wall_s": wall,
        "reference_s": ref["seconds"],
        "reference_digest": sorted(reference),
        "final_digests": digests,
        "segments": len(segments),
        "rounds": len({(r.segment, r.round) for r in records}),
        "faults": recs,
        "mix": _mix([f.kind for f in cfg.faults], recs),
        "recovery_s": summarize([r["recovery_s"] for r in recs if r["recovery_s"] is not None]),
        "job_restarts": _job_restarts(segments, records, recs, cfg.ranks),
        "disk": {**disk_check, "stray_tmp": stray_tmp},
        "leaks": _leaks(segments) + [f"/dev/shm: {n}" for n in shm_new],
        "fds_after_return": _fds_after_return(segments),
        # what each process that returned normally (done or idle) still held
        "fds_left_by_process": {
            f"s{seg.index}-p{p}": r.get("fds_left", {})
            for seg in segments
            for p, r in sorted(seg.results.items())
            if r["outcome"] in ("done", "idle")
        },
        "rss": rss,
        "rss_judged": [f"s{r['segment']}-p{r['process']}" for r in judged],
        "missing_faults": missing,
        "unrecovered_faults": unrecovered,
        "problems": problems,
    }


def show(res: dict[str, Any]) -> None:
    rows = [
        (
            f["label"],
            f"s{f['segment']}r{f['round']}",
            f.get("target_pid") or "",
            "yes" if f.get("injected") else "NO",
            f["rounds"],
            "yes" if f["job_restart"] else "",
            "-" if f["recovery_s"] is None else round(f["recovery_s"], 2),
        )
        for f in res["faults"]
    ]
    print_table(
        "faults (recovery: fault -> every active rank training again)",
        ("fault", "where", "target pid", "injected", "new rounds", "job restart", "recovery s"),
        rows,
    )
    mix = [
        (k, m["planned"], m["injected"], m["recovered"], m["job_restarts"],
         m["recovery_s"]["p50"], m["recovery_s"]["p95"], m["recovery_s"]["max"])
        for k, m in sorted(res["mix"].items())
    ]  # fmt: skip
    heads = ("kind", "planned", "injected", "recovered", "job restarts", "p50 s", "p95 s", "max s")
    print_table("fault mix", heads, mix)
    jr = [
        (j["segment"], j["after_fault"] or "-", j["restart_s"] or "-") for j in res["job_restarts"]
    ]
    if jr:
        print_table(
            "job-level restarts (segment end -> every rank training)", ("segment", "after", "s"), jr
        )
    rss = [
        (
            f"s{r['segment']}-p{r['process']}",
            r["samples"],
            r["first_mib"],
            r["last_mib"],
            r["growth_mib"],
        )
        for r in res["rss"]
    ]
    if rss:
        print_table(
            "RSS (median MiB, first vs last quarter of steps)",
            ("process", "steps", "first", "last", "growth"),
            rss,
        )
    summary = [
        ("faults", len(res["faults"])),
        ("segments (job starts)", res["segments"]),
        ("restart rounds", res["rounds"]),
        ("wall s", res["wall_s"]),
        (
            "recovery p50 / p95 / max s",
            "{p50:.2f} / {p95:.2f} / {max:.2f}".format(**res["recovery_s"]),
        ),
        (
            "disk checkpoints committed / uncommitted",
            f"{len(res['disk']['committed'])} / {len(res['disk']['uncommitted'])}",
        ),
        ("disk", res["disk_mode"]),
    ] + [(name, "ok" if ok else "FAILED") for name, ok in res["checks"].items()]
    print_table("summary", ("", ""), summary)
    for key in ("problems", "leaks", "fds_after_return", "missing_faults", "unrecovered_faults"):
        for item in res[key]:
            print(f"{key}: {item}")
    for item in res["disk"]["problems"]:
        print(f"checkpoint problem: {item}")
    print(f"\nsoak {'PASSED' if res['passed'] else 'FAILED'}; run directory {res['config']['out']}")
