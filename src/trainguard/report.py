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
  the next round: process group, checkpoint load). Each boundary is clamped to be no earlier
  than the previous one. other = wall - productive - stalls - faults (startup, gaps, the end).
- goodput = productive / wall.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["Fault", "Report", "analyze", "format_table", "load"]

DETECTION_KINDS = ("fault", "hang", "rank_gone", "hard_timeout", "sidecar_lost")
PHASES = ("recomputed", "detection", "abort", "barrier", "reinit")
_PHASE_NAMES = {
    "recomputed": "recomputed",
    "detection": "detection",
    "abort": "abort",
    "barrier": "restart barrier",
    "reinit": "re-initialization",
}

# injections that do not end a round by themselves (a deleted local checkpoint directory is only
# noticed at the next load): never taken as the moment of the round's fault
PASSIVE_INJECTIONS = frozenset({"lostdir"})
MAX_FAULT_ROWS = 20  # the table details this many faults and sums up the others in one row
Span = tuple[float, float]


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

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for fault, data in zip(self.faults, out["faults"], strict=True):
            data["total"] = fault.total
        return out


# interval arithmetic ------------------------------------------------------------------------
def _union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(spans: list[Span], cuts: list[Span]) -> list[Span]:
    out: list[Span] = []
    cuts = _union(cuts)
    for a, b in _union(spans):
        for c, d in cuts:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _measure(spans: list[Span]) -> float:
    return sum(b - a for a, b in _union(spans))


def _start(event: dict[str, Any]) -> float:
    duration = event.get("duration")
    if isinstance(duration, (int, float)) and math.isfinite(duration):
        return float(event["time"]) - float(duration)
    return float(event["time"])


# the timeline -------------------------------------------------------------------------------
class _Timeline:
    """The events of one run sorted and grouped by round (shared with the plot)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = sorted(
            (e for e in events if isinstance(e.get("time"), (int, float))),
            key=lambda e: float(e["time"]),
        )
        if not self.events:
            raise ValueError("no events to report on")
        self.round_start: dict[int, list[float]] = defaultdict(list)
        for e in self.of("round_start"):
            if isinstance(e.get("round"), int):
                self.round_start[e["round"]].append(float(e["time"]))
        starts = sorted((min(t), n) for n, t in self.round_start.items())
        self._bounds = [t for t, _ in starts]
        self._rounds = [n for _, n in starts]
        # (round, step) -> [earliest start, latest end] over ranks
        self.steps: dict[tuple[int, int], list[float]] = {}
        for e in self.of("train_step"):
            if isinstance(e.get("step"), int):
                self._grow(self.steps, (self.round_of(e), e["step"]), e)
        self.stalls: dict[tuple[int, Any, str], list[float]] = {}
        for e in self.of("ckpt_stall"):
            self._grow(self.stalls, (self.round_of(e), e.get("step"), str(e.get("what"))), e)
        latest: dict[int, int] = {}
        for n, s in self.steps:
            latest[s] = max(latest.get(s, n), n)
        self.kept = {key: latest[key[1]] == key[0] for key in self.steps}
        self.rounds = sorted(set(self.round_start) | {n for n, _ in self.steps})
        # per round: its step keys, its stalls, and its fault-related events by kind
        self.round_steps: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for key in self.steps:
            self.round_steps[key[0]].append(key)
        self.round_stalls: dict[int, list[tuple[Any, float]]] = defaultdict(list)
        for (n, step, _), (_, end) in self.stalls.items():
            self.round_stalls[n].append((step, end))
        self.in_round: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
        for e in self.of("demo_fault", "abort", *DETECTION_KINDS):
            self.in_round[self.round_of(e), e["kind"]].append(e)

    @staticmethod
    def _grow(groups: dict[Any, list[float]], key: Any, e: dict[str, Any]) -> None:
        span = groups.setdefault(key, [math.inf, -math.inf])
        span[0] = min(span[0], _start(e))
        span[1] = max(span[1], float(e["time"]))

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") in kinds]

    def found(self, n: int, *kinds: str) -> list[dict[str, Any]]:
        """Round ``n``'s events of these kinds (among demo_fault, abort, detections), by time."""
        out = [e for kind in kinds for e in self.in_round.get((n, kind), ())]
        return sorted(out, key=lambda e: float(e["time"]))

    def round_of(self, e: dict[str, Any]) -> int:
        """The event's round stamp; a sidecar's events (no stamp) go by ``gone_round`` or time."""
        if isinstance(e.get("round"), int):
            return int(e["round"])
        if isinstance(e.get("gone_round"), int):
            return int(e["gone_round"])
        i = bisect.bisect_right(self._bounds, float(e["time"])) - 1
        return self._rounds[i] if i >= 0 else (self._rounds[0] if self._rounds else 0)

    def wall(self) -> Span:
        firsts = [min(t) for t in self.round_start.values()]
        firsts += [s for s, _ in self.steps.values()] + [s for s, _ in self.stalls.values()]
        t0 = min(firsts) if firsts else float(self.events[0]["time"])
        ends = [float(e["time"]) for e in self.of("complete", "end", "train_step")]
        t1 = max(ends) if ends else float(self.events[-1]["time"])
        return t0, max(t0, t1)

    def first_step(self, n: int) -> float | None:
        starts = [s for (r, _), (s, _) in self.steps.items() if r == n]
        return min(starts) if starts else None


def _describe(e: dict[str, Any] | None) -> tuple[str, int | None, str]:
    """(kind, faulted rank, cause) from a detection event."""
    if e is None:
        return "unknown", None, ""
    kind = e["kind"]
    if kind == "fault":
        return f"exception ({e.get('type', '?')})", e.get("rank"), str(e.get("error", ""))
    if kind == "rank_gone":
        return "rank gone", e.get("gone_rank"), str(e.get("cause", ""))
    what = kind.replace("_", " ")
    return what, e.get("rank"), str(e.get("reason", e.get("exitcode", "")))


def _fault(tl: _Timeline, n: int, nxt: int | None, lo: float, hi: float) -> Fault:
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
    seen = [_start(e) for e in detections] + [_start(e) for e in aborts]
    detected = min(seen) if seen else None
    injected = tl.found(n, "demo_fault")
    ending = [e for e in injected if e.get("fault") not in PASSIVE_INJECTIONS] or injected
    before = [e for e in ending if detected is None or float(e["time"]) <= detected]
    chosen = before[-1] if before else (ending[0] if ending else None)
    first = min(detections, key=_start) if detections else None
    kind, rank, cause = _describe(first)
    if first is None and aborts:
        rank, cause = aborts[0].get("fault_rank"), str(aborts[0].get("cause", ""))
    if chosen is not None:
        p1 = float(chosen["time"])
        kind = str(chosen.get("fault", kind))
        rank = chosen["target"] if isinstance(chosen.get("target"), int) else rank
    else:
        p1 = _start(first) if first is not None else detected if detected is not None else p0
    p2 = detected if detected is not None else p1
    p3 = max((float(e["time"]) for e in aborts), default=p2)
    p4 = max(tl.round_start[nxt]) if nxt is not None and tl.round_start.get(nxt) else p3
    p5 = tl.first_step(nxt) if nxt is not None else None
    bounds = []
    for p in (p0, p1, p2, p3, p4, p5 if p5 is not None else p4):
        lo = min(max(p, lo), hi)
        bounds.append(lo)
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
    )


def analyze(events: list[dict[str, Any]]) -> Report:
    """The goodput report of one run's merged events (see the module docstring)."""
    tl = _Timeline(events)
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
    productive = _subtract(kept_spans, cuts)
    stall_spans: dict[str, list[Span]] = defaultdict(list)
    for (_, _, what), (s, e) in tl.stalls.items():
        stall_spans[what].append((s, e))
    stalls = _subtract([s for v in stall_spans.values() for s in v], cuts + kept_spans)
    faults = [_shifted(f, t0) for f in faults]
    wall = t1 - t0
    fault_total = sum((f.total for f in faults), 0.0)
    p, st = _measure(productive), _measure(stalls)
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
    ranks = sorted({e["rank"] for e in tl.events if isinstance(e.get("rank"), int)})
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
            what: {"count": len(spans), "seconds": _measure(_subtract(spans, cuts + kept_spans))}
            for what, spans in sorted(stall_spans.items())
        },
        faults=faults,
        notes=notes,
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


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_table(report: Report) -> str:
    """A plain-text table whose rows add up to the wall time."""
    wall = report.wall

    def row(label: str, seconds: float, indent: int = 2) -> str:
        pct = f"{100 * seconds / wall:6.1f} %" if wall > 0 else "      -"
        return f"{' ' * indent}{label:<52}{seconds:10.3f} s  {pct}"

    stall_what = ", ".join(f"{int(v['count'])} {what}" for what, v in report.ckpt_stalls.items())
    lines = [
        f"trainguard report: {_n(len(report.ranks), 'rank')}, {_n(report.rounds, 'round')}, "
        f"{_n(report.steps_kept, 'step')} kept, {report.recomputed_steps} recomputed, "
        f"{_n(len(report.faults), 'fault')}",
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
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)
