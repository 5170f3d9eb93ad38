"""A run's events laid out on one timeline: steps and stalls grouped by round, fault events by
round, and the interval arithmetic of :mod:`trainguard.report`.

What the report (``__init__``) and the plot (:mod:`._plot`) share is here, so that neither
imports a private name of the other.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any

from trainguard.events import well_formed
from trainguard.report._launch import renumber

DETECTION_KINDS = (
    "fault",
    "hang",
    "rank_gone",
    "hard_timeout",
    "sidecar_lost",
    "launch_worker_died",
    "launch_node_lost",
)
Span = tuple[float, float]
# a share of re-initialization -> the event kinds that make it, in the order shares take an
# instant (see trainguard.report._reinit)
REINIT_SOURCES = {
    "checkpoint_load": ("ckpt_load", "local_ckpt_load", "live_recover"),
    "checkpointer": ("ckpt_setup",),
    "process_group": ("pg_setup",),
}
REINIT_KINDS = tuple(kind for kinds in REINIT_SOURCES.values() for kind in kinds)


def union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(spans: list[Span], cuts: list[Span]) -> list[Span]:
    out: list[Span] = []
    cuts = union(cuts)
    for a, b in union(spans):
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


def measure(spans: list[Span]) -> float:
    return sum(b - a for a, b in union(spans))


def start_of(event: dict[str, Any]) -> float:
    duration = event.get("duration")
    if isinstance(duration, (int, float)) and math.isfinite(duration):
        return float(event["time"]) - float(duration)
    return float(event["time"])


class Timeline:
    """The events of one run sorted and grouped by round (shared with the plot)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        ordered = sorted((e for e in events if well_formed(e)), key=lambda e: float(e["time"]))
        if not ordered:
            raise ValueError("no events to report on")
        # generation -> its first round here, where a whole-job restart began again at round 0
        self.events, self.moved = renumber(ordered)
        self._last_seen: dict[int, float] = {}  # pid -> time of its last event
        for e in self.events:
            if type(e.get("pid")) is int:
                self._last_seen[e["pid"]] = float(e["time"])
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
        kinds = ("demo_fault", "abort", "launch_escalated", *DETECTION_KINDS, *REINIT_KINDS)
        for e in self.of(*kinds):
            self.in_round[self.round_of(e), e["kind"]].append(e)

    @staticmethod
    def _grow(groups: dict[Any, list[float]], key: Any, e: dict[str, Any]) -> None:
        span = groups.setdefault(key, [math.inf, -math.inf])
        span[0] = min(span[0], start_of(e))
        span[1] = max(span[1], float(e["time"]))

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") in kinds]

    def found(self, n: int, *kinds: str) -> list[dict[str, Any]]:
        """Round ``n``'s events of these kinds (among demo_fault, abort, detections and the
        set-up and load events of :data:`REINIT_KINDS`), by time."""
        out = [e for kind in kinds for e in self.in_round.get((n, kind), ())]
        return sorted(out, key=lambda e: float(e["time"]))

    def round_of(self, e: dict[str, Any]) -> int:
        """The event's round stamp; a sidecar's events (no stamp) go by ``gone_round`` or time;
        a launcher's ``launch_worker_died`` by the time of the dead process's last event (the
        launcher may notice the exit after the survivors began their next round)."""
        if isinstance(e.get("round"), int):
            return int(e["round"])
        if isinstance(e.get("gone_round"), int):
            return int(e["gone_round"])
        at = float(e["time"])
        if e.get("kind") == "launch_worker_died" and type(e.get("worker_pid")) is int:
            at = min(at, self._last_seen.get(e["worker_pid"], at))
        i = bisect.bisect_right(self._bounds, at) - 1
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
