"""The timeline picture of ``trainguard report RUN_DIR --plot FILE.png``.

One lane per rank (the rank stamped on the events, which is a process's launch rank: a spare
keeps its own lane). On each lane: training steps (kept, recomputed), checkpoint stalls and
aborts of that rank, its process-group set-ups, checkpointer set-ups and checkpoint loads (the
shares of re-initialization, :mod:`trainguard.report._reinit`), a marker at a fault on its
target rank, and one where the rank was first named a straggler. Across all lanes: each fault's
detection, restart barrier and re-initialization phases, and a dashed line where each round
began. The x axis is seconds from the report's start.

Under ``trainguard launch``: a marker on the lane of the rank concerned where the launcher saw
a worker die, respawned it, or a round admitted it, and on the lost ranks' lanes where a node
was lost; a dotted line across all lanes for a whole-job restart, a replacement node and each
new generation. The agents (negative ranks) get no lane.

matplotlib is optional (``pip install 'trainguard[report]'``) and imported only here, with the
Agg canvas and no pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from trainguard.report import Report
from trainguard.report._launch import is_rank, plural
from trainguard.report._timeline import REINIT_SOURCES, Timeline, start_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_timeline"]

COLORS = {
    "kept": "#4c9f50",
    "recomputed": "#f28e2b",
    "stall": "#7b5ea7",
    "abort": "#c0392b",
    "pg_setup": "#1f77b4",
    "ckpt_setup": "#17becf",
    "ckpt_load": "#8c564b",
    "detection": "#e74c3c",
    "barrier": "#95a5a6",
    "reinit": "#f1c40f",
}
_LABELS = {
    "kept": "training step (kept)",
    "recomputed": "training step (recomputed)",
    "stall": "checkpoint stall",
    "abort": "abort (per rank)",
    "pg_setup": "process-group set-up",
    "ckpt_setup": "checkpointer set-up",
    "ckpt_load": "checkpoint find/load",
    "detection": "detection",
    "barrier": "restart barrier",
    "reinit": "re-initialization",
}
_REINIT_BARS = {
    "process_group": "pg_setup",
    "checkpointer": "ckpt_setup",
    "checkpoint_load": "ckpt_load",
}
_HINT = "install it with: pip install 'trainguard[report]'"

_Bars = dict[tuple[int, str], list[tuple[float, float]]]  # (lane, what) -> [(start, width)]


def plot_timeline(
    events: list[dict[str, Any]], report: Report, path: str | os.PathLike[str]
) -> None:
    """Draw the run's timeline into ``path`` (PNG); ImportError naming the extra without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not installed; {_HINT}") from exc

    tl = Timeline(events)
    ranks = sorted({e["rank"] for e in tl.events if is_rank(e.get("rank"))})
    lane = {r: i for i, r in enumerate(ranks)}
    fig = Figure(figsize=(12, 1.6 + 0.45 * max(1, len(ranks))), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_bars(ax, _bars(tl, report.start, lane), report.wall)
    _draw_faults(ax, report, lane)
    top = -0.6
    _draw_rounds(ax, tl, report, top)
    shown = _draw_launcher(ax, report, lane, top)
    shown += _draw_stragglers(ax, report, lane)
    ax.set_yticks(list(lane.values()), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, top - 0.3)
    ax.set_xlim(0, max(report.wall, 1e-6) * 1.02)
    ax.set_xlabel("seconds from start")
    _add_title_and_legend(ax, report, len(ranks), shown)
    fig.savefig(os.fspath(path), format="png", bbox_inches="tight")


def _bars(tl: Timeline, t0: float, lane: dict[int, int]) -> _Bars:
    """Each rank's steps (kept or recomputed), checkpoint stalls and aborts, from ``t0``."""
    bars: _Bars = {}

    def add(e: dict[str, Any], what: str) -> None:
        if e.get("rank") in lane:
            start = start_of(e) - t0
            bars.setdefault((lane[e["rank"]], what), []).append(
                (start, float(e["time"]) - t0 - start)
            )

    for e in tl.of("train_step"):
        if isinstance(e.get("step"), int):
            add(e, "kept" if tl.kept.get((tl.round_of(e), e["step"]), True) else "recomputed")
    for e in tl.of("ckpt_stall"):
        add(e, "stall")
    for e in tl.of("abort"):
        add(e, "abort")
    for part, kinds in REINIT_SOURCES.items():
        for e in tl.of(*kinds):
            add(e, _REINIT_BARS[part])
    return bars


def _draw_bars(ax: Axes, bars: _Bars, wall: float) -> None:
    height = 0.6
    for (y, what), spans in sorted(bars.items()):
        # a minimum width so that a 1 ms span still shows on a minutes-long run
        width = max(wall, 1e-9) / 1500
        spans = [(s, max(w, width)) for s, w in spans]
        ax.broken_barh(
            spans,
            (y - height / 2, height),
            facecolors=COLORS[what],
            edgecolor="white",
            linewidth=0.3,
        )


def _draw_faults(ax: Axes, report: Report, lane: dict[int, int]) -> None:
    """Each fault's phases across all lanes, and a marker on its target rank's lane."""
    for fault in report.faults:
        b = fault.bounds
        for name, (a, z) in (
            ("detection", (b[1], b[2])),
            ("barrier", (b[3], b[4])),
            ("reinit", (b[4], b[5])),
        ):
            if z > a:
                ax.axvspan(a, z, color=COLORS[name], alpha=0.35, linewidth=0)
        ys = [lane[fault.rank]] if fault.rank in lane else list(lane.values())
        ax.plot([fault.time] * len(ys), ys, "X", color="black", markersize=11, zorder=5)


def _draw_rounds(ax: Axes, tl: Timeline, report: Report, top: float) -> None:
    """A dashed line where each round began, labelled above the lanes at ``top``."""
    labelled = -float("inf")
    for n, times in sorted(tl.round_start.items()):
        x = min(times) - report.start
        ax.axvline(x, color="#333333", linestyle="--", linewidth=0.8)
        if x - labelled >= report.wall / 16:  # labels of rounds close together would overlap
            ax.text(x, top, f" round {n}", va="bottom", ha="left", fontsize=8)
            labelled = x


# launcher event -> (marker, colour, legend label); on the lanes of the ranks it concerns
_MARKS = {
    "launch_worker_died": ("x", "#c0392b", "worker died (launcher)"),
    "launch_respawned": ("^", "#2874a6", "worker respawned"),
    "launch_admitted": (">", "#117a65", "admitted into a round"),
    "launch_node_lost": ("v", "#6c3483", "node lost"),
}
# launcher event -> (colour, label) of a job-level line
_LINES = {
    "launch_escalated": ("#c0392b", "whole-job restart"),
    "launch_node_back": ("#6c3483", "node back"),
    "launch_generation": ("#2874a6", "generation"),
}


def _draw_launcher(ax: Axes, report: Report, lane: dict[int, int], top: float) -> list[str]:
    """Markers and lines of ``trainguard launch``'s events; the kinds drawn."""
    shown: list[str] = []
    first_generation = min(
        (r.get("generation", 0) for r in report.launcher if r["kind"] == "launch_generation"),
        default=0,
    )
    for r in report.launcher:
        kind, x = r["kind"], r["at"]
        if kind in _MARKS:
            marker, color, _ = _MARKS[kind]
            ranks = r.get("ranks") if kind == "launch_node_lost" else [r.get("slot", r.get("rank"))]
            ys: list[float] = [lane[k] for k in ranks or () if k in lane]
            if not ys:  # no lane of its own: at the top, job level
                ys = [top + 0.15]
            ax.plot([x] * len(ys), ys, marker, color=color, markersize=9, zorder=6)
        elif kind in _LINES:
            if kind == "launch_generation" and r.get("generation", 0) == first_generation:
                continue
            color, label = _LINES[kind]
            ax.axvline(x, color=color, linestyle=":", linewidth=1.4)
            name = f"{label} {r.get('generation')}" if kind == "launch_generation" else label
            ax.text(x, top + 0.25, f" {name}", va="top", ha="left", fontsize=7, color=color)
        else:
            continue
        if kind not in shown:
            shown.append(kind)
    return shown


_STRAGGLER = ("d", "#d35400", "straggler named (first window)")


def _draw_stragglers(ax: Axes, report: Report, lane: dict[int, int]) -> list[str]:
    """A marker on each named straggler's lane where it was first named."""
    named = [r for r in report.stragglers.get("ranks", ()) if r["named"] and r["rank"] in lane]
    marker, color, _ = _STRAGGLER
    for r in named:
        ax.plot([r["first"]], [lane[r["rank"]]], marker, color=color, markersize=10, zorder=6)
    return ["straggler"] if named else []


def _add_title_and_legend(ax: Axes, report: Report, ranks: int, shown: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    goodput = "unknown" if report.goodput is None else f"{100 * report.goodput:.1f} %"
    ax.set_title(
        f"{plural(ranks, 'rank')}, {plural(report.rounds, 'round')}, "
        f"{plural(len(report.faults), 'fault')}, "
        f"goodput {goodput}",
        fontsize=10,
    )
    handles: list[Any] = [Patch(color=COLORS[k], label=v) for k, v in _LABELS.items()]
    handles.append(Line2D([], [], marker="X", color="black", linestyle="", label="fault"))
    for kind in shown:
        if kind == "straggler":
            marker, color, label = _STRAGGLER
            handles.append(Line2D([], [], marker=marker, color=color, linestyle="", label=label))
        elif kind in _MARKS:
            marker, color, label = _MARKS[kind]
            handles.append(Line2D([], [], marker=marker, color=color, linestyle="", label=label))
        else:
            color, label = _LINES[kind]
            handles.append(Line2D([], [], color=color, linestyle=":", label=label))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
