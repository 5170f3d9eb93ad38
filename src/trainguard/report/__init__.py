"""Goodput report: how a run's wall time splits into kept training, checkpoint stalls and faults.

Built from the event log alone (``trainguard report RUN_DIR``; :func:`load`, :func:`analyze`,
:func:`format_table`). Every time comes from the events themselves, so ranks on several hosts
work as long as their clocks agree roughly; nothing assumes one host.

Event contract. Besides the library's own events (``round_start``, ``fault``, ``hang``,
``rank_gone``, ``hard_timeout``, ``sidecar_lost``, ``abort``, ``complete``, ``end``), the
training loop emits:

- ``train_step`` at the END of every step, on every rank: ``step`` (int, the global step
  number), ``duration`` (seconds of the step's compute and collectives, checkpoint saves
  excluded), optional ``loss``.
- ``ckpt_stall``: a span around each checkpoint save inside the loop, the time the loop was
  blocked by it: ``with events.span("ckpt_stall", what="local" or "disk", step=s): save(...)``,
  ``step`` being the last step whose result the checkpoint holds.
- ``demo_fault`` (optional), by a fault injector at the moment it injects: ``fault`` (a kind
  such as ``"exception"``, ``"hang"``, ``"kill"``, ``"lostdir"``), ``step``, ``target`` (rank).
  Without it, a fault's time is its first detection event and its detection time is unknown (0).
  When a round holds several, its fault's moment is the last one at or before the first
  detection; ``"lostdir"`` (noticed only at the next load) is never taken as that moment.

How the timeline is cut (job level, across ranks):

- wall: the first ``round_start`` (or step, or event) to the last ``complete``/``end``/
  ``train_step``.
- A step's execution in a round spans [earliest start, latest end] over ranks (start = time -
  duration). It is *kept* unless a later round runs the same step number again (*recomputed*).
- productive: the union of kept step spans. checkpoint stalls: the union of ``ckpt_stall``
  spans (per round, step and ``what``: earliest start to latest end) outside productive time.
- per fault (a round followed by another round, or a last round with a fault event), five
  consecutive intervals: **recomputed** (end of the round's last kept step, or of the
  checkpoint stall of that step or the next step number if later, to the fault), **detection** (fault to the first ``fault``/``hang``/
  ``rank_gone``/``hard_timeout``/``sidecar_lost`` event or ``abort`` start), **abort** (to the
  last ``abort`` end of the round), **restart barrier** (to the LATEST ``round_start`` of the
  next round over ranks, spares included), **re-initialization** (to the earliest step start of
  the next round), split into process-group set-up, checkpointer set-up, checkpoint find/load
  (from memory, a file or a peer) and the rest, with the next round's first step and the time
  to *training again* beside it (:mod:`trainguard.report._reinit`). Each boundary is clamped
  to be no earlier than the previous one. other = wall - productive - stalls - faults (startup, gaps, the end).
- goodput = productive / wall.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainguard._subproc import exit_text
from trainguard.report import _reinit
from trainguard.report._hosts import lines as host_lines
from trainguard.report._hosts import summary as host_summary
from trainguard.report._launch import (
    is_rank,
    plural,
    root_cause,
    section,
    summary,
    target,
)
from trainguard.report._stragglers import lines as straggler_lines
from trainguard.report._stragglers import summary as straggler_summary
from trainguard.report._timeline import (
    DETECTION_KINDS,
    Span,
    Timeline,
    measure,
    start_of,
    subtract,
)

__all__ = ["Fault", "Report", "analyze", "format_table", "load"]

PHASES = ("recomputed", "detection", "abort", "barrier", "reinit")
_PHASE_NAMES = {
    "recomputed": "recomputed",
    "detection": "detection",
    "abort": "abort",
    "barrier": "restart barrier",
    "reinit": "re-initialization",
}

# injections that do not end a round by themselves (a deleted local checkpoint directory is only
# noticed at the next load; a slowdown is no fault until a policy acts on it): never taken as
# the moment of the round's fault
PASSIVE_INJECTIONS = frozenset({"lostdir", "slow"})
MAX_FAULT_ROWS = 20  # the table details this many faults and sums up the others in one row


@dataclasses.dataclass
class Fault:
    """One fault and what it cost; times in seconds from the report's start."""

    round: int
    kind: str  # demo_fault's ``fault``, else derived from the detection event
    rank: int | None  # the faulted (target) rank
    cause: str
    step: int | None  # the step of the injection, when known
    time: float  # the fault's moment
    recomputed_steps: int
    restarted: bool  # a next round started
    injected: list[str]  # the ``fault`` of every demo_fault of the round, in time order
    phases: dict[str, float]  # PHASES -> seconds, consecutive, adding up to ``total``
    bounds: list[float]  # the six boundaries of the five phases
    # re-initialization's shares (_reinit.REINIT_PARTS -> seconds, adding up to phases["reinit"])
    reinit: dict[str, float] = dataclasses.field(default_factory=dict)
    load_source: str = ""  # where the next round's checkpoint came from: memory, file, peer
    first_step: float | None = None  # the next round's first step, earliest start to latest end
    training_again: float | None = None  # the fault's moment to the end of that first step

    @property
    def total(self) -> float:
        return self.bounds[-1] - self.bounds[0]


@dataclasses.dataclass
class Report:
    """A run's goodput; every duration in seconds. ``to_dict()`` gives plain JSON types."""

    start: float  # epoch seconds of the wall's start
    wall: float
    productive: float
    ckpt_stall: float
    fault_total: float
    other: float  # wall - productive - ckpt_stall - fault_total
    goodput: float | None  # None without train_step events
    rounds: int
    ranks: list[int]
    steps_kept: int  # distinct step numbers whose execution was kept
    step_executions: int  # (round, step) executions, kept or recomputed
    recomputed_steps: int
    ckpt_stalls: dict[str, dict[str, float]]  # what -> {"count", "seconds"}
    faults: list[Fault]
    notes: list[str]
    # ``trainguard launch``'s events (see trainguard.report._launch.summary), by time
    launcher: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # ranks named slower than the others (see trainguard.report._stragglers.summary)
    stragglers: dict[str, Any] = dataclasses.field(default_factory=dict)
    # background saves that failed and were reported (``ckpt_failure``: training went on), and
    # saves whose tensors equal the previous save's (``ckpt_unchanged``), one per rank each
    failed_saves: int = 0
    unchanged_saves: int = 0
    # faults per host, quarantined hosts (see trainguard.report._hosts.summary)
    hosts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for fault, data in zip(self.faults, out["faults"], strict=True):
            data["total"] = fault.total
        return out


def _describe(e: dict[str, Any] | None) -> tuple[str, int | None, str]:
    """(kind, faulted rank, cause) from a detection event."""
    if e is None:
        return "unknown", None, ""
    kind = e["kind"]
    if kind == "fault":
        return f"exception ({e.get('type', '?')})", e.get("rank"), str(e.get("error", ""))
    if kind == "rank_gone":
        return "rank gone", e.get("gone_rank"), str(e.get("cause", ""))
    if kind == "launch_worker_died":
        return "worker died", target(e), exit_text(e.get("exit_code"))
    if kind == "launch_node_lost":
        return f"node {e.get('node')} lost", target(e), f"ranks {e.get('ranks')}"
    what = kind.replace("_", " ")
    return what, target(e), str(e.get("reason", e.get("exitcode", "")))


def _fault(tl: Timeline, n: int, nxt: int | None, lo: float, hi: float) -> Fault:
    mine = tl.round_steps.get(n, [])
    kept = [key for key in mine if tl.kept[key]]
    if kept:
        last = max(s for _, s in kept)
        p0 = max(tl.steps[key][1] for key in kept)
        p0 = max([p0] + [end for s, end in tl.round_stalls.get(n, []) if s in (last, last + 1)])
    elif mine:
        p0 = min(tl.steps[key][0] for key in mine)
    else:
        p0 = min(tl.round_start.get(n, [lo]))
    detections = tl.found(n, *DETECTION_KINDS)
    aborts = tl.found(n, "abort")
    seen = [start_of(e) for e in detections] + [start_of(e) for e in aborts]
    detected = min(seen) if seen else None
    injected = tl.found(n, "demo_fault")
    ending = [e for e in injected if e.get("fault") not in PASSIVE_INJECTIONS] or injected
    before = [e for e in ending if detected is None or float(e["time"]) <= detected]
    chosen = before[-1] if before else (ending[0] if ending else None)
    first = min(detections, key=start_of) if detections else None
    kind, rank, cause = _describe(root_cause(sorted(detections, key=start_of)))
    if first is None and aborts:
        rank, cause = aborts[0].get("fault_rank"), str(aborts[0].get("cause", ""))
        if cause == "admit":  # no fault: a returning process is laid out with the others
            kind, cause = "admission", "a respawned or replacement process joins"
    if chosen is not None:
        p1 = float(chosen["time"])
        kind = str(chosen.get("fault", kind))
        rank = chosen["target"] if isinstance(chosen.get("target"), int) else rank
    else:
        p1 = start_of(first) if first is not None else detected if detected is not None else p0
    p2 = detected if detected is not None else p1
    escalated = tl.found(n, "launch_escalated")
    if escalated:
        kind += " -> whole-job restart"
        cause = (
            f"{cause}; {escalated[0].get('reason', '')}"
            if cause
            else str(escalated[0].get("reason", ""))
        )
    p3 = max((float(e["time"]) for e in aborts), default=p2)
    p4 = max(tl.round_start[nxt]) if nxt is not None and tl.round_start.get(nxt) else p3
    p5 = tl.first_step(nxt) if nxt is not None else None
    bounds = []
    for p in (p0, p1, p2, p3, p4, p5 if p5 is not None else p4):
        lo = min(max(p, lo), hi)
        bounds.append(lo)
    shares, source = _reinit.split(tl, nxt, bounds[4], bounds[5])
    step = _reinit.first_step(tl, nxt)
    return Fault(
        round=n,
        kind=kind,
        rank=rank if isinstance(rank, int) else None,
        cause=cause,
        step=chosen.get("step") if chosen is not None else None,
        injected=[str(e.get("fault")) for e in injected],
        time=bounds[1],
        recomputed_steps=len(mine) - len(kept),
        restarted=nxt is not None,
        phases={name: bounds[i + 1] - bounds[i] for i, name in enumerate(PHASES)},
        bounds=bounds,
        reinit=shares,
        load_source=source,
        first_step=step[1] - step[0] if step is not None else None,
        training_again=step[1] - bounds[1] if step is not None else None,
    )


def analyze(events: list[dict[str, Any]]) -> Report:
    """The goodput report of one run's merged events (see the module docstring)."""
    tl = Timeline(events)
    t0, t1 = tl.wall()
    faults: list[Fault] = []
    lo = t0
    for i, n in enumerate(tl.rounds):
        nxt = tl.rounds[i + 1] if i + 1 < len(tl.rounds) else None
        if nxt is None and not tl.found(n, *DETECTION_KINDS):
            continue
        fault = _fault(tl, n, nxt, lo, t1)
        faults.append(fault)
        lo = fault.bounds[-1]
    cuts = [(-math.inf, t0), (t1, math.inf)] + [(f.bounds[0], f.bounds[-1]) for f in faults]
    kept_spans = [(s, e) for key, (s, e) in tl.steps.items() if tl.kept[key]]
    productive = subtract(kept_spans, cuts)
    stall_spans: dict[str, list[Span]] = defaultdict(list)
    for (_, _, what), (s, e) in tl.stalls.items():
        stall_spans[what].append((s, e))
    stalls = subtract([s for v in stall_spans.values() for s in v], cuts + kept_spans)
    faults = [_shifted(f, t0) for f in faults]
    wall = t1 - t0
    fault_total = sum((f.total for f in faults), 0.0)
    p, st = measure(productive), measure(stalls)
    other = wall - p - st - fault_total
    notes: list[str] = []
    if not tl.steps:
        notes.append(
            "no train_step events: productive time and goodput are unknown (emit train_step "
            "at the end of every step; see trainguard.report)"
        )
    timeless = sum(
        1 for e in tl.of("train_step") if not isinstance(e.get("duration"), (int, float))
    )
    if timeless:
        notes.append(
            f"{timeless} train_step events have no duration: those steps count as 0 s of "
            "productive time"
        )
    if not tl.round_start:
        notes.append("no round_start events: the run did not use trainguard.restart")
    notes += [
        f"generation {g} (a whole-job restart) began again at round 0: its rounds are "
        f"numbered from {first} here"
        for g, first in sorted(tl.moved.items())
    ]
    ranks = sorted({e["rank"] for e in tl.events if is_rank(e.get("rank"))})
    return Report(
        start=t0,
        wall=wall,
        productive=p,
        ckpt_stall=st,
        fault_total=fault_total,
        other=other if abs(other) > 1e-9 else 0.0,
        goodput=(p / wall if wall > 0 else 0.0) if tl.steps else None,
        rounds=len(tl.rounds),
        ranks=ranks,
        steps_kept=len({s for (_, s), k in tl.kept.items() if k}),
        step_executions=len(tl.steps),
        recomputed_steps=sum(1 for k in tl.kept.values() if not k),
        ckpt_stalls={
            what: {"count": len(spans), "seconds": measure(subtract(spans, cuts + kept_spans))}
            for what, spans in sorted(stall_spans.items())
        },
        faults=faults,
        notes=notes,
        launcher=summary(tl.events, t0),
        stragglers=straggler_summary(tl.events, t0),
        failed_saves=sum(1 for e in tl.events if e.get("kind") == "ckpt_failure"),
        unchanged_saves=sum(1 for e in tl.events if e.get("kind") == "ckpt_unchanged"),
        hosts=host_summary(tl.events),
    )


def _shifted(f: Fault, t0: float) -> Fault:
    return dataclasses.replace(f, bounds=[b - t0 for b in f.bounds], time=f.time - t0)


def load(run_dir: str | Path) -> Report:
    """Read every event file under ``run_dir`` and analyze them; ValueError if there are none."""
    from trainguard.events import read_events

    merged = read_events(run_dir)
    if not merged:
        raise ValueError(f"no events under {run_dir} (expected events-*.jsonl files)")
    return analyze(merged)


def format_table(report: Report) -> str:
    """A plain-text table whose rows add up to the wall time."""
    wall = report.wall

    def row(label: str, seconds: float, indent: int = 2) -> str:
        pct = f"{100 * seconds / wall:6.1f} %" if wall > 0 else "      -"
        return f"{' ' * indent}{label:<52}{seconds:10.3f} s  {pct}"

    stall_what = ", ".join(f"{int(v['count'])} {what}" for what, v in report.ckpt_stalls.items())
    lines = [
        f"trainguard report: {plural(len(report.ranks), 'rank')}, {plural(report.rounds, 'round')}, "
        f"{plural(report.steps_kept, 'step')} kept, {report.recomputed_steps} recomputed, "
        f"{plural(len(report.faults), 'fault')}",
        row("wall", wall, 0),
        row("productive (kept steps)", report.productive),
        row(f"checkpoint stalls ({stall_what or 'none'})", report.ckpt_stall),
    ]
    shown = report.faults[:MAX_FAULT_ROWS]
    for i, f in enumerate(shown, 1):
        where = f"rank {f.rank}" if f.rank is not None else "rank ?"
        at = f" at step {f.step}" if f.step is not None else ""
        lines.append(row(f"fault {i}: round {f.round}, {f.kind} on {where}{at}", f.total))
        for name in PHASES:
            label = _PHASE_NAMES[name]
            if name == "recomputed":
                label += f" ({f.recomputed_steps} steps)"
            lines.append(row(label, f.phases[name], 6))
            if name == "reinit":
                lines += _reinit.rows(f.reinit, f.load_source, row)
        if f.training_again is not None and f.first_step is not None:
            lines.append(
                f"      stepping again {f.training_again:.3f} s after the fault (first step "
                f"of the next round: {f.first_step:.3f} s, counted as productive)"
            )
        if f.cause:
            lines.append(f"      cause: {f.cause[:90]}")
    rest = report.faults[len(shown) :]
    if rest:
        label = f"faults {len(shown) + 1}-{len(report.faults)} (see --json)"
        lines.append(row(label, sum(f.total for f in rest)))
    lines.append(row("other (startup, between steps, shutdown)", report.other))
    if report.goodput is None:
        lines.append("goodput: unknown")
    else:
        lines.append(f"goodput: {100 * report.goodput:.1f} % (productive / wall)")
    if report.failed_saves or report.unchanged_saves:
        lines.append(
            f"checkpoint saves: {report.failed_saves} failed and reported (training went on, "
            f"the previous checkpoint stayed the latest), {report.unchanged_saves} identical to "
            "the save before (is the saved state the one training updates?)"
        )
    lines += section(report.launcher)
    lines += straggler_lines(report.stragglers)
    lines += host_lines(report.hosts)
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)
