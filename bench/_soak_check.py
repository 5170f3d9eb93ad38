"""The soak's checks, read from what the processes left in the run directory.

- :func:`steps` and :func:`injected`: the step log lines and the fault log;
- :func:`recoveries`: each fault's recovery time (fault -> every active rank training again);
- :func:`verify_disk`: every committed disk checkpoint loads (every rank's part), passes
  ``trainguard ckpt verify``, holds the step its name says and the reference run's parameters;
- :func:`leftovers`: processes that carry the run's marker, new entries in ``/dev/shm``;
- :func:`rss_trend`: RSS in the first and last quarter of each rank process's steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepRecord:
    segment: int
    process: int
    round: int
    rank: int
    step: int
    time: float
    rss_kib: int


def steps(out: Path) -> list[StepRecord]:
    """Every step line of every process, in time order."""
    records = []
    for path in (out / "steps").glob("s*-p*.log"):
        seg, proc = (int(x) for x in path.stem[1:].split("-p"))
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) != 5:
                continue  # a line cut short by SIGKILL
            rnd, rank, step = (int(x) for x in fields[:3])
            records.append(StepRecord(seg, proc, rnd, rank, step, float(fields[3]), int(fields[4])))
    records.sort(key=lambda r: r.time)
    return records


def injected(out: Path) -> list[dict[str, Any]]:
    path = out / "faults.jsonl"
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda f: f["time"])


def recoveries(
    faults: list[dict[str, Any]], records: list[StepRecord], ranks: int
) -> list[dict[str, Any]]:
    """Each fault with ``recovery_s``: from the fault to the moment every active rank has taken
    a step in the round that went on after it (the last round started between this fault and
    the next, or the fault's own round when none started), ``None`` when that never happened;
    ``rounds`` counts the rounds started in between, ``job_restart`` tells whether that round
    belongs to a later job segment."""
    firsts: dict[tuple[int, int], float] = {}
    for r in records:
        firsts.setdefault((r.segment, r.round), r.time)
    out = []
    for i, fault in enumerate(faults):
        t0 = fault["time"]
        t1 = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        started = sorted((t, key) for key, t in firsts.items() if t0 < t < t1)
        key = started[-1][1] if started else (fault["segment"], fault["round"])
        first_step: dict[int, float] = {}
        for r in records:
            if (r.segment, r.round) == key and r.time > t0 and r.rank not in first_step:
                first_step[r.rank] = r.time
        done = len(first_step) == ranks
        out.append(
            {
                **fault,
                "rounds": len({k for _, k in started if k[0] == key[0]}),
                "job_restart": key[0] != fault["segment"],
                "recovered_in": list(key),
                "recovery_s": max(first_step.values()) - t0 if done else None,
            }
        )
    return out


def _cli_verify(path: Path) -> tuple[int, str]:
    """``trainguard ckpt verify PATH``, run in this process (same code as the command)."""
    from trainguard import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main(["ckpt", "verify", str(path)])
    return code, buf.getvalue()


def verify_disk(root: Path, ranks: int, reference: dict[int, str]) -> dict[str, Any]:
    """Check every committed checkpoint under ``root`` (see the module docstring).

    ``reference`` maps a step to the fault-free run's parameters digest after that step."""
    from trainguard.checkpoint import load
    from trainguard.demo import model as m

    committed, uncommitted, problems = [], [], []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")):
        if not (path / "COMMITTED").exists():
            uncommitted.append(path.name)
            continue
        committed.append(path.name)
        step = int(path.name.split("_")[-1])
        code, text = _cli_verify(path)
        if code != 0:
            problems.append(f"{path.name}: ckpt verify failed: {text.strip()[-300:]}")
        for rank in range(ranks):
            try:
                state = load(path, rank=rank)
                net = m.make_model(m.TaskConfig())
                net.load_state_dict(state["model"])
                digest = m.parameters_digest(net)
            except Exception as exc:
                problems.append(f"{path.name} rank {rank}: {type(exc).__name__}: {exc}")
                continue
            if int(state["step"]) != step:
                problems.append(f"{path.name} rank {rank}: holds step {state['step']}")
            if reference.get(step) not in (None, digest):
                problems.append(f"{path.name} rank {rank}: parameters differ from the reference")
    return {"committed": committed, "uncommitted": uncommitted, "problems": problems}


def marked_processes(marker: str) -> list[int]:
    """pids of live processes whose environment holds ``SOAK_MARKER=marker``."""
    needle = f"SOAK_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    found.remove(int(entry))  # a zombie holds nothing; its parent reaps it
        except (OSError, ValueError):
            continue
    return found


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def rss_trend(records: list[StepRecord], *, min_samples: int = 40) -> list[dict[str, Any]]:
    """Per rank process with at least ``min_samples`` steps: median RSS (MiB) of the first and
    the last quarter of its steps."""
    by_proc: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in records:
        by_proc[(r.segment, r.process)].append(r.rss_kib)
    rows = []
    for (seg, proc), values in sorted(by_proc.items()):
        if len(values) < min_samples:
            continue
        q = len(values) // 4
        first, last = statistics.median(values[:q]) / 1024, statistics.median(values[-q:]) / 1024
        rows.append(
            {
                "segment": seg,
                "process": proc,
                "samples": len(values),
                "first_mib": round(first, 1),
                "last_mib": round(last, 1),
                "growth_mib": round(last - first, 1),
            }
        )
    return rows


def rss_flat(row: dict[str, Any]) -> bool:
    """The limit the soak holds RSS to: at most 10 % or 20 MiB more, whichever is larger."""
    return bool(row["growth_mib"] <= max(0.10 * row["first_mib"], 20.0))
