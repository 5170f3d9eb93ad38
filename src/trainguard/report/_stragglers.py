"""The report's straggler part: which ranks were named slower than the others, and what happened.

Read from the ``straggler`` events (one per window in which a rank's relative score was below
the threshold, emitted by that rank: ``section``, ``relative``, ``individual``, ``action``)
and the ``straggler_window`` events (one per scored window, from the round's rank 0:
``slowest`` as ``[rank, relative score, section]``, lowest first).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from trainguard.report._launch import is_rank, plural

__all__ = ["lines", "summary"]


def summary(events: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """``{"windows": scored windows, "ranks": [...]}``: the ranks named, most windows first, each
    with ``rank``, ``host``, ``windows`` (named in), ``first`` (s from ``t0``), ``relative``
    (median over those windows), ``worst``, ``section`` and ``action`` (the last one); or,
    when none was named, the slowest ranks of the scored windows (``named`` False)."""
    named: dict[int, list[dict[str, Any]]] = defaultdict(list)
    scored = 0
    seen: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for e in events:
        if e.get("kind") == "straggler" and is_rank(e.get("rank")):
            named[e["rank"]].append(e)
        elif e.get("kind") == "straggler_window":
            scored += 1
            for item in e.get("slowest") or ():
                if isinstance(item, list) and len(item) == 3 and is_rank(item[0]):
                    seen[item[0]].append((float(item[1]), str(item[2])))
    ranks = [_named(rank, evs, t0) for rank, evs in named.items()]
    if not ranks:
        ranks = [
            {
                "rank": rank,
                "named": False,
                "relative": statistics.median(s for s, _ in scores),
                "section": min(scores)[1],
            }
            for rank, scores in seen.items()
        ]
    if named:  # the most persistent first
        ranks.sort(key=lambda r: (-r["windows"], r["worst"], r["rank"]))
    else:
        ranks.sort(key=lambda r: (r["relative"], r["rank"]))
    return {"windows": scored, "ranks": ranks[:5] if not named else ranks}


def _named(rank: int, evs: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    scores = [float(e.get("relative", 1.0)) for e in evs]
    worst = min(evs, key=lambda e: float(e.get("relative", 1.0)))
    return {
        "rank": rank,
        "named": True,
        "host": worst.get("host"),
        "windows": len(evs),
        "first": min(float(e["time"]) for e in evs) - t0,
        "relative": statistics.median(scores),
        "worst": min(scores),
        "section": worst.get("section"),
        "action": evs[-1].get("action"),
    }


def lines(part: dict[str, Any]) -> list[str]:
    """The report's lines about stragglers (none when no window was scored)."""
    ranks = part.get("ranks") or []
    if not part.get("windows") and not ranks:
        return []
    if not any(r["named"] for r in ranks):
        slow = ", ".join(
            f"rank {r['rank']} {r['relative']:.2f} ({r['section']})" for r in ranks[:3]
        )
        return [
            f"stragglers: none named in {plural(part['windows'], 'scored window')}"
            + (f"; slowest: {slow}" if slow else "")
        ]
    steady = [r for r in ranks if r["windows"] > 1] or ranks[:1]
    once = [r for r in ranks if r not in steady]
    out = [
        f"stragglers: {plural(len(steady), 'rank')} named slower than the others, most often first"
    ]
    for r in steady:
        out.append(
            f"  rank {r['rank']} on {r['host']}: {plural(r['windows'], 'window')} from "
            f"{r['first']:.1f} s, section {r['section']!r}, relative score {r['relative']:.2f} "
            f"(worst {r['worst']:.2f}); {r['action']}"
        )
    if once:
        blips = ", ".join(f"rank {r['rank']} ({r['section']}, {r['worst']:.2f})" for r in once)
        out.append(f"  below the threshold in one window only: {blips}")
    return out
