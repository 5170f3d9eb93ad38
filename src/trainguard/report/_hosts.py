"""The report's hosts part: the faults of each host, and which hosts were quarantined.

Read from the ``fault_attributed`` events (one per round that ended with a fault, from the
next round's first rank: ``fault_host``, ``fault_rank``, ``fault_kind``, ``cause`` (kind and
place), ``counted``: False for a cause seen on several hosts, a software bug), and the
``host_quarantined`` / ``host_readmitted`` events (``quarantined_host``, ``why``), see
:mod:`trainguard.restart.quarantine`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from trainguard.report._launch import plural

__all__ = ["lines", "summary"]


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"hosts": [...], "software": {cause: faults}}``: per host (most counted faults first)
    ``host``, ``faults``, ``counted``, ``causes`` (cause -> count), ``quarantined`` (the last
    why, or None), ``readmitted`` (times)."""
    faults: dict[str, list[dict[str, Any]]] = defaultdict(list)
    software: Counter[str] = Counter()
    out: dict[str, str | None] = {}
    back: Counter[str] = Counter()
    for e in events:
        kind = e.get("kind")
        if kind == "fault_attributed":
            host = str(e.get("fault_host") or "?")
            faults[host].append(e)
            if not e.get("counted") and e.get("fault_host"):
                software[str(e.get("cause"))] += 1
        elif kind == "host_quarantined":
            out[str(e.get("quarantined_host"))] = str(e.get("why", ""))
        elif kind == "host_readmitted":
            back[str(e.get("quarantined_host"))] += 1
        elif kind == "host_released":  # taken out for what proved a software bug
            out.pop(str(e.get("quarantined_host")), None)
    hosts: list[dict[str, Any]] = []
    for host in sorted(set(faults) | set(out)):
        evs = faults.get(host, [])
        hosts.append(
            {
                "host": host,
                "faults": len(evs),
                "counted": sum(1 for e in evs if e.get("counted")),
                "causes": dict(Counter(str(e.get("cause")) for e in evs).most_common()),
                "quarantined": out.get(host),
                "readmitted": back.get(host, 0),
            }
        )
    hosts.sort(key=lambda h: (-h["counted"], -h["faults"], h["host"]))
    # a cause counted on no host is a software bug: listed once, not per host
    return {"hosts": hosts, "software": dict(software.most_common())}


def lines(part: dict[str, Any]) -> list[str]:
    """The report's lines about hosts (none when no fault was attributed)."""
    hosts = part.get("hosts") or []
    if not hosts:
        return []
    out = [f"faults by host: {plural(len(hosts), 'host')}, most counted faults first"]
    for h in hosts:
        listed = list(h["causes"].items())
        causes = "; ".join(f"{n} x {c}" for c, n in listed[:3])
        if len(listed) > 3:  # the rest in `trainguard report --json`
            causes += f"; {sum(n for _, n in listed[3:])} more of {len(listed) - 3} other cause(s)"
        line = f"  {h['host']}: {plural(h['faults'], 'fault')} ({h['counted']} counted): {causes}"
        if h["quarantined"] is not None:
            line += f"; quarantined: {h['quarantined']}"
            if h["readmitted"]:
                line += f", readmitted {h['readmitted']}x"
        out.append(line)
    software = part.get("software") or {}
    if software:
        seen = "; ".join(f"{n} x {c}" for c, n in software.items())
        out.append(f"  counted against no host (the same cause on several hosts): {seen}")
    return out
