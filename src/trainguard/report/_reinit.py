"""Where a fault's re-initialization goes, and when training is going again.

Re-initialization is the interval from the latest ``round_start`` of the next round to the
earliest start of that round's first step. It is split into consecutive shares that add up to it,
from these events of the next round (each a span ``[time - duration, time]`` on some rank):

- **checkpoint find/load**: ``ckpt_load``, ``local_ckpt_load`` and ``live_recover``; their
  ``source`` field (``"memory"``, ``"file"`` or ``"peer"``: a part fetched from a peer;
  ``"live"``: the survivors' live state, :mod:`trainguard.live`) names where it came from;
- **checkpointer set-up**: ``ckpt_setup`` (a checkpointer built, or re-bound to the new round);
- **process-group set-up**: ``pg_setup`` (recorded by the restart wrapper around every process
  group built while it runs: the rendezvous on the round's store and the group's constructor;
  see :mod:`trainguard.restart.abort`);
- **other**: the rest (the function's own set-up: model, optimizer, data).

Each instant of the interval during which some rank ran one of these counts once, for the first
of them in that order (a load that overlaps a set-up on another rank is a load). The next
round's **first step** (earliest start to latest end over ranks of its first step number) stays
productive time, so the rows of the report still add up to the wall time; it is reported next
to the split, with **training again**: the fault's moment to the end of that first step (every
active rank has finished a step of the new round).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.report._timeline import REINIT_SOURCES, Span, Timeline, measure, start_of, subtract

__all__ = ["NAMES", "REINIT_PARTS", "first_step", "recovery_line", "rows", "split"]

REINIT_PARTS = ("process_group", "checkpointer", "checkpoint_load", "other")
NAMES = {
    "process_group": "process-group set-up",
    "checkpointer": "checkpointer set-up",
    "checkpoint_load": "checkpoint find/load",
    "other": "other (the function's own set-up)",
}


def split(tl: Timeline, nxt: int | None, lo: float, hi: float) -> tuple[dict[str, float], str]:
    """The shares of ``[lo, hi]`` (see the module docstring) and the loads' sources joined
    by ``+`` (``""`` when nothing was loaded)."""
    out = dict.fromkeys(REINIT_PARTS, 0.0)
    if nxt is None or hi <= lo:
        return out, ""
    taken: list[Span] = []
    for part, kinds in REINIT_SOURCES.items():
        spans = [(max(start_of(e), lo), min(float(e["time"]), hi)) for e in tl.found(nxt, *kinds)]
        spans = [s for s in spans if s[1] > s[0]]
        out[part] = measure(subtract(spans, taken))
        taken += spans
    out["other"] = max(0.0, (hi - lo) - sum(out.values()))
    loads = tl.found(nxt, *REINIT_SOURCES["checkpoint_load"])
    return out, "+".join(sorted({str(e["source"]) for e in loads if e.get("source")}))


def first_step(tl: Timeline, nxt: int | None) -> Span | None:
    """The next round's first step number: (earliest start, latest end) over ranks."""
    if nxt is None:
        return None
    numbers = [s for n, s in tl.round_steps.get(nxt, []) if n == nxt]
    if not numbers:
        return None
    span = tl.steps[(nxt, min(numbers))]
    return span[0], span[1]


def rows(shares: dict[str, float], source: str, row: Callable[[str, float, int], str]) -> list[str]:
    """The table's lines under a fault's re-initialization row (none when no set-up or load
    event was recorded); ``row(label, seconds, indent)`` formats one."""
    if not any(shares.get(p, 0.0) > 0 for p in REINIT_PARTS if p != "other"):
        return []
    lines = []
    for part in REINIT_PARTS:
        label = NAMES[part] + (f" ({source})" if part == "checkpoint_load" and source else "")
        lines.append(row(label, shares[part], 8))
    return lines


def recovery_line(i: int, fault: Any) -> str | None:
    """One line on how fault ``i`` (a :class:`trainguard.report.Fault`) was recovered from:
    the fault's moment to every rank's first step of the next round, in consecutive parts
    that add up (None when no next round trained)."""
    if fault.training_again is None:
        return None
    ph, re = fault.phases, fault.reinit
    step = fault.training_again - (ph["detection"] + ph["abort"] + ph["barrier"] + ph["reinit"])
    parts = [
        ("detection", ph["detection"]),
        ("abort", ph["abort"]),
        ("barrier", ph["barrier"]),
        ("process group", re.get("process_group", 0.0)),
        ("checkpointer", re.get("checkpointer", 0.0)),
        (f"load ({fault.load_source or 'none'})", re.get("checkpoint_load", 0.0)),
        ("other set-up", re.get("other", ph["reinit"])),
        ("first step", max(0.0, step)),
    ]
    where = f"rank {fault.rank}" if fault.rank is not None else "rank ?"
    at = f" at step {fault.step}" if fault.step is not None else ""
    return (
        f"  {i}. {fault.kind} on {where}{at}: {fault.recomputed_steps} steps recomputed, "
        f"stepping again after {fault.training_again:.3f} s = "
        + " + ".join(f"{name} {1e3 * s:.0f} ms" for name, s in parts)
    )
