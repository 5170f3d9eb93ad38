"""Scores of one window: how each rank's times compare with the fastest rank's and its own best.

Pure functions over what the ranks published for a window (one entry per rank: its initial
rank and the median time of each section over its recent samples):

- **relative score** of a rank on a section: ``(fastest + floor) / (own + floor)``, where
  ``fastest`` is the smallest median of that section over the ranks that published it. 1.0 is
  the fastest rank; 0.5 takes twice as long. ``floor`` is the ``floor`` setting (seconds)
  plus :data:`STEP_SHARE` of the fastest rank's median step time: a section too short to
  matter for the step cannot turn timer noise into a low score (a section that adds a
  quarter of a step to one rank still scores about 0.8). A rank's relative score is its
  lowest over the sections (the step time counts only for a rank that names none), and that
  section is the one it is slow in.
- **individual score**: the same ratio against the rank's own best median of the section in
  earlier windows (a whole job that slows down lowers everyone's individual score, and no
  one's relative score).

A rank is a straggler in a window when its relative score is below the threshold.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from trainguard.stragglers._timing import STEP

__all__ = [
    "STEP_SHARE",
    "RankScore",
    "entry_line",
    "individual",
    "parse_entries",
    "relative",
    "slowest",
]

#: the share of the fastest median step time added to each ratio's floor
STEP_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class RankScore:
    """A rank's relative score in one window, and the section it is slowest in."""

    rank: int
    score: float
    section: str
    own: float  # its median time of that section (seconds)
    fastest: float  # the fastest rank's median of that section
    fastest_rank: int


def _ratio(best: float, own: float, floor: float) -> float:
    return min(1.0, (best + floor) / (own + floor)) if own + floor > 0 else 1.0


def relative(entries: Mapping[int, Mapping[str, float]], floor: float) -> dict[int, RankScore]:
    """Each rank's relative score; ``entries`` maps initial rank -> section -> median."""
    fastest: dict[str, tuple[float, int]] = {}
    for rank, medians in sorted(entries.items()):
        for name, value in medians.items():
            if name not in fastest or value < fastest[name][0]:
                fastest[name] = (value, rank)
    floor += STEP_SHARE * fastest.get(STEP, (0.0, 0))[0]
    out = {}
    for rank, medians in entries.items():
        worst: RankScore | None = None
        # with named sections the step time does not count here: in a synchronous job every
        # rank's step lasts as long as the slowest's, and what differs is scheduling noise
        named = any(name != STEP for name in medians)
        for name, value in sorted(medians.items()):
            if named and name == STEP:
                continue
            best, who = fastest[name]
            score = _ratio(best, value, floor)
            if worst is None or score < worst.score:
                worst = RankScore(rank, score, name, value, best, who)
        if worst is not None:
            out[rank] = worst
    return out


def individual(
    medians: Mapping[str, float], best: dict[str, float], floor: float
) -> tuple[float, str]:
    """This rank's individual score and its section; updates ``best`` (its best medians)."""
    worst, where = 1.0, ""
    for name, value in sorted(medians.items()):
        score = _ratio(best.get(name, value), value, floor)
        if score < worst or not where:
            worst, where = min(worst, score), name
        best[name] = min(best.get(name, value), value)
    return worst, where


def parse_entries(raw: bytes | str, limit: int) -> dict[int, dict[str, float]]:
    """The window's entries (one JSON object per line), checked: a line that is not an entry
    of a rank below ``limit`` with finite non-negative medians is skipped (values read from a
    store are validated before they decide anything)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        entry = _entry(line, limit)
        if entry is not None:
            out[entry[0]] = entry[1]
    return out


def _entry(line: str, limit: int) -> tuple[int, dict[str, float]] | None:
    try:
        data: Any = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    rank, medians = data.get("i"), data.get("m")
    if type(rank) is not int or not 0 <= rank < limit or not isinstance(medians, dict):
        return None
    clean = {
        str(k): float(v)
        for k, v in medians.items()
        if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
    }
    return rank, clean


def entry_line(initial_rank: int, medians: Mapping[str, float]) -> str:
    """One rank's published line for a window."""
    return json.dumps({"i": initial_rank, "m": dict(medians)}, separators=(",", ":")) + "\n"


def slowest(scores: Iterable[RankScore], n: int) -> list[RankScore]:
    """The ``n`` lowest-scoring ranks, lowest first."""
    return sorted(scores, key=lambda s: (s.score, s.rank))[:n]
