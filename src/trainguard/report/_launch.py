"""What ``trainguard launch`` adds to a run's events, as the report reads it.

The launcher's agents write into the same event directory as their workers, stamped with the
negative rank ``-1 - node`` (they are not training ranks) and no round: ``launch_generation``
(``generation``, ``node``, ``nodes``, ``store``), ``launch_worker_died`` (``slot``: the initial
rank, ``worker_pid``, ``exit_code``, ``incarnation``), ``launch_respawned`` (``slot``,
``worker_pid``, ``incarnation``, ``seconds`` since the death), ``launch_node_lost`` (``node``,
``ranks``, ``generation``), ``launch_node_back`` (``node``, ``generation``) and
``launch_escalated`` (``reason``, ``generation``). Their sidecar service writes ``rank_gone`` and
``hard_timeout`` with no rank at all. A respawned or replacement worker writes
``launch_admitted`` (its ``rank``, ``incarnation``, ``waited``) when a round takes it in.

Here: which events are the launcher's, the round renumbering across generations (a whole-job
restart begins again at round 0; the report numbers rounds across generations so that they
stay apart), the target rank of a detection, and the lines of the table's "Launcher" section.
"""

from __future__ import annotations

import bisect
from typing import Any

from trainguard._subproc import exit_text


def plural(count: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count and its noun, as the table and the plot write it."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


LAUNCH_KINDS = (
    "launch_generation",
    "launch_worker_died",
    "launch_respawned",
    "launch_node_lost",
    "launch_node_back",
    "launch_escalated",
    "launch_admitted",
)
# detections that say a process (or a node's processes) is gone, most telling first
DEATH_KINDS = ("launch_node_lost", "rank_gone", "hard_timeout", "launch_worker_died")


def is_rank(value: object) -> bool:
    """A training rank: an int >= 0 (an agent stamps ``-1 - node``; a service stamps None)."""
    return type(value) is int and value >= 0


def generation_starts(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(first ``launch_generation`` time, generation) of each generation, by time."""
    first: dict[int, float] = {}
    for e in events:
        g = e.get("generation")
        if e.get("kind") == "launch_generation" and type(g) is int:
            first[g] = min(first.get(g, float(e["time"])), float(e["time"]))
    return sorted((t, g) for g, t in first.items())


def renumber(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """``events`` (sorted by time) with the rounds of each later generation moved past those of
    the one before; and generation -> its first round number here (only where it moved)."""
    starts = generation_starts(events)
    if len(starts) < 2:
        return events, {}
    times = [t for t, _ in starts]
    highest: dict[int, int] = {}
    which: list[int] = []
    for e in events:
        k = max(0, bisect.bisect_right(times, float(e["time"])) - 1)
        which.append(k)
        for key in ("round", "gone_round"):
            if type(e.get(key)) is int:
                highest[k] = max(highest.get(k, -1), e[key])
    offsets = [0]
    for k in range(1, len(starts)):
        offsets.append(offsets[-1] + highest.get(k - 1, -1) + 1)
    out: list[dict[str, Any]] = []
    for e, k in zip(events, which, strict=True):
        if offsets[k]:
            e = dict(e)
            for key in ("round", "gone_round"):
                if type(e.get(key)) is int:
                    e[key] += offsets[k]
        out.append(e)
    moved = {starts[k][1]: offsets[k] for k in range(1, len(starts)) if offsets[k]}
    return out, moved


def target(e: dict[str, Any]) -> int | None:
    """The rank a detection or launcher event concerns (a slot is an initial rank)."""
    kind = e.get("kind")
    if kind == "rank_gone":
        value = e.get("gone_rank")
    elif kind in ("launch_worker_died", "launch_respawned"):
        value = e.get("slot")
    elif kind == "hard_timeout" and is_rank(e.get("killed_rank")):
        value = e.get("killed_rank")
    elif kind == "launch_node_lost":
        ranks = e.get("ranks")
        value = min((r for r in ranks if is_rank(r)), default=None) if ranks else None
    else:
        value = e.get("rank")
    return value if is_rank(value) else None


def root_cause(detections: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The detection that best says why a round failed, ``detections`` by time.

    The first detection is often a survivor's collective error caused by another process's
    death; when a death of another rank is among them, that death is the cause: the dead rank's
    own ``fault``/``hang`` if it wrote one, else the most telling death event."""
    if not detections:
        return None
    first = detections[0]
    deaths = [e for e in detections if e["kind"] in DEATH_KINDS and target(e) is not None]
    if not deaths or first["kind"] in DEATH_KINDS:
        return first
    dead = {target(e) for e in deaths}
    if target(first) in dead:
        return first
    rank = target(deaths[0])
    own = [e for e in detections if e["kind"] in ("fault", "hang") and e.get("rank") == rank]
    if own:
        return own[0]
    return min(deaths, key=lambda e: DEATH_KINDS.index(e["kind"]))


def summary(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The launcher's events (and the service's ``rank_gone``) as plain records: ``at`` (seconds
    from ``t0``), ``kind`` and the fields the table shows."""
    out: list[dict[str, Any]] = []
    for e in events:
        kind = e.get("kind")
        agent = type(e.get("rank")) is int and e["rank"] < 0
        if kind not in LAUNCH_KINDS or (kind != "launch_admitted" and not agent):
            continue
        record: dict[str, Any] = {"at": float(e["time"]) - t0, "kind": kind}
        if agent:
            record["node"] = -1 - e["rank"]
        if kind in ("launch_node_lost", "launch_node_back"):
            record["lost_node"] = e.get("node")
        for key in (
            "generation",
            "nodes",
            "slot",
            "rank",
            "worker_pid",
            "exit_code",
            "incarnation",
            "seconds",
            "waited",
            "ranks",
            "reason",
            "round",
        ):
            if key in e and not (key == "rank" and agent):
                record[key] = e[key]
        out.append(record)
    return out


def _line(r: dict[str, Any]) -> str:
    kind = r["kind"]
    where = f"node {r['node']}: " if "node" in r else ""
    if kind == "launch_generation":
        nodes = r.get("nodes")
        text = f"generation {r.get('generation')} started"
        text += f" ({plural(nodes, 'node')})" if type(nodes) is int else ""
    elif kind == "launch_worker_died":
        text = (
            f"rank {r.get('slot')} (incarnation {r.get('incarnation')}, pid "
            f"{r.get('worker_pid')}) died: {exit_text(r.get('exit_code'))}"
        )
    elif kind == "launch_respawned":
        seconds = r.get("seconds")
        after = f" {seconds:.3f} s after its death" if isinstance(seconds, float) else ""
        text = (
            f"rank {r.get('slot')} respawned as incarnation {r.get('incarnation')} "
            f"(pid {r.get('worker_pid')}){after}"
        )
    elif kind == "launch_node_lost":
        text = (
            f"node {r.get('lost_node')} lost (ranks {r.get('ranks')}), generation "
            f"{r.get('generation')}"
        )
    elif kind == "launch_node_back":
        text = (
            f"node {r.get('lost_node')} is back (a replacement), generation {r.get('generation')}"
        )
    elif kind == "launch_escalated":
        text = f"whole-job restart of generation {r.get('generation')}: {r.get('reason')}"
    else:
        waited = r.get("waited")
        after = f" after waiting {waited:.3f} s" if isinstance(waited, float) else ""
        text = (
            f"rank {r.get('rank')} (incarnation {r.get('incarnation')}) admitted in round "
            f"{r.get('round')}{after}"
        )
    return f"  {r['at']:9.3f} s  {where}{text}"


def section(records: list[dict[str, Any]]) -> list[str]:
    """The table's "Launcher" section: one line per event; nothing without launcher events."""
    if not records:
        return []
    counts = {
        k: sum(1 for r in records if r["kind"] == k)
        for k in ("launch_worker_died", "launch_respawned", "launch_escalated")
    }
    gens = {r.get("generation") for r in records if r["kind"] == "launch_generation"}
    head = (
        f"launcher: {plural(len(gens), 'generation')}, "
        f"{plural(counts['launch_worker_died'], 'worker death')}, "
        f"{plural(counts['launch_respawned'], 'respawn')}, "
        f"{plural(counts['launch_escalated'], 'whole-job restart')}"
    )
    return [head] + [_line(r) for r in records]
