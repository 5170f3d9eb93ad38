"""What the job shares, per restart round (issue 34): the rows and targets of bench/coord_scale.py.

From what :func:`bench._coord_sim.rounds` measured per round (the store process's CPU, the
simulated ranks' and the node helpers' threads' CPU, the requests), :func:`shared` makes one
size's numbers: the store server's busy time, requests per rank, CPU per rank and per node, and
the cluster round time and death notice -> every node aware modelled from them
(:mod:`bench._coord_cpu`); :func:`row` and :func:`targets` print them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import _coord_cpu
from bench._common import summarize
from bench._coord_cpu import ROUND_TRIPS
from bench._coord_worker import LOCAL

RTT = 50e-6  # s, one network round trip on a cluster fabric (a parameter: --rtt)

__all__ = ["HEADERS", "ROUND_TRIPS", "RTT", "by_op", "row", "shared", "targets", "targets_42"]


def shared(
    n: int,
    cpu: list[dict[str, Any]],
    per_rank: list[float],
    relay: bool,
    rtt: float,
    round_trips: int,
) -> dict[str, Any]:
    """What the job shares, per round (issue 34): the store server's busy time, the requests
    per rank, each rank's and each node's CPU, and the modelled cluster round time and death
    notice -> every node aware beside them (see :mod:`bench._coord_cpu`)."""
    model, aware = [], []
    for c in cpu:
        nodes = -(-c["ranks"] // LOCAL)
        terms = _coord_cpu.modelled(
            c, ranks=c["ranks"], nodes=nodes, rtt=rtt, round_trips=round_trips
        )
        model.append(terms)
        if c["kind"] == "notice":
            waiters = nodes if relay else c["ranks"]
            aware.append(
                _coord_cpu.notice_aware(
                    c["server_busy_s"],
                    c["requests"],
                    waiters=waiters,
                    node_s=terms["node_s"],
                    rtt=rtt,
                )
            )
    busy = [c["server_busy_s"] for c in cpu]
    per_node = [c["requests"] / -(-c["ranks"] // LOCAL) for c in cpu]
    return {
        "ranks": n,
        "rtt_s": rtt,
        "round_trips": round_trips,
        "server_busy_s": summarize(busy),
        "server_busy_per_round_s": busy,
        "server_thread_s": summarize([c["server_thread_s"] for c in cpu]),
        "server_us_per_request": summarize(
            [1e6 * c["server_busy_s"] / c["requests"] for c in cpu if c["requests"]]
        ),
        "requests_per_round": [c["requests"] for c in cpu],
        "requests_per_rank": summarize(per_rank),
        "requests_per_rank_per_round": per_rank,
        "requests_per_node": summarize(per_node),
        "node_requests_by_op": by_op(cpu),
        "rank_cpu_s": summarize([t["rank_s"] for t in model]),
        "last_arriver_s": summarize([t["last_arriver_s"] for t in model]),
        "node_cpu_s": summarize([t["node_s"] for t in model]),
        "modelled_round_s": summarize([t["modelled_round_s"] for t in model]),
        "model_per_round": model,
        "modelled_notice_aware_s": summarize(aware),
        "cpu_per_round": cpu,
    }


def by_op(cpu: list[dict[str, Any]]) -> dict[str, float]:
    """The node helpers' requests per node per round by name and key (``wait rN/stop``), the
    median over the rounds (a round that lacks one counts 0)."""
    rounds = [
        (c.get("node_requests_by_op") or {}, -(-c["ranks"] // LOCAL)) for c in cpu if c["ranks"]
    ]
    ops = sorted({op for counts, _ in rounds for op in counts})
    return {op: summarize([c.get(op, 0) / nodes for c, nodes in rounds])["p50"] for op in ops}


HEADERS = [
    "N",
    "code",
    "server busy s",
    "server us/req",
    "req/rank",
    "rank CPU ms",
    "last arriver ms",
    "node CPU ms",
    "modelled round s",
    "simulated round s",
    "modelled notice->nodes s",
    "simulated notice->ranks s",
    "hb req/interval/node",
    "load",
]


def row(label: str, m: dict[str, Any]) -> list[Any]:
    """One size's row of what the job shares (p50 over the rounds; requests per rank: mean)."""
    return [
        m["n"],
        label,
        m["server_busy_s"]["p50"],
        m["server_us_per_request"]["p50"],
        m["requests_per_rank"]["mean"],
        1e3 * m["rank_cpu_s"]["p50"],
        1e3 * m["last_arriver_s"]["p50"],
        1e3 * m["node_cpu_s"]["p50"],
        m["modelled_round_s"]["p50"],
        m["round_s"]["p50"],
        m["modelled_notice_aware_s"]["p50"],
        m["notice_aware_s"]["p50"],
        m.get("liveness_requests_per_node", "-"),
        f"{m.get('load_before', 0):.1f}/{m.get('load_after', 0):.1f}",
    ]


_Row = tuple[str, str, float | None, float]  # what, the target's text, measured, limit


def _table(
    current: list[dict[str, Any]],
    rows: Callable[[dict[str, Any], int], list[_Row]],
    *,
    live_label: str,
    after: Callable[[dict[str, Any], int], list[_Row]] | None = None,
) -> list[list[Any]]:
    """An issue's targets table at 16,384 ranks (the largest size measured when it was not):
    ``rows(big, n)``, the liveness row (labelled ``live_label``) when liveness was measured,
    ``after(big, n)`` next, and the growth of the server's busy time to 4x the ranks when that
    size was measured; each with the value measured and met or not."""
    at = [m for m in current if m["n"] == 16384] or current[-1:]
    big = at[0]
    n = big["n"]
    table = rows(big, n)
    live = [m for m in current if "liveness_requests_per_node" in m]
    if live:
        value = live[-1]["liveness_requests_per_node"]
        table.append((live_label.format(n=live[-1]["n"]), "<= 2", value, 2.0))
    if after is not None:
        table.extend(after(big, n))
    bigger = [m for m in current if m["n"] == 4 * n]
    if bigger:
        growth = bigger[0]["server_busy_s"]["p50"] / big["server_busy_s"]["p50"]
        table.append((f"growth of the server's busy time {n} -> {4 * n}", "<= 4.5x", growth, 4.5))
    return [
        [name, text, v, "yes" if v is not None and v <= limit else "NO"]
        for name, text, v, limit in table
    ]


def targets(current: list[dict[str, Any]]) -> list[list[Any]]:
    """Issue 34's table: each target at 16,384 ranks (the largest size measured when it was
    not), the value measured, met or not."""

    def rows(big: dict[str, Any], n: int) -> list[_Row]:
        return [
            (
                f"store server busy time per restart round p50, N={n}",
                "<= 0.05 s",
                big["server_busy_s"]["p50"],
                0.05,
            ),
            (
                f"modelled round time on a cluster p50, N={n}, RTT {1e6 * big['rtt_s']:g} us",
                "<= 0.3 s",
                big["modelled_round_s"]["p50"],
                0.3,
            ),
            (
                f"store requests per rank per round, averaged, N={n}",
                "<= 0.75",
                big["requests_per_rank"]["mean"],
                0.75,
            ),
        ]

    def notice(big: dict[str, Any], n: int) -> list[_Row]:
        return [
            (
                f"death notice -> every node aware, modelled p50, N={n}",
                "<= 0.1 s",
                big["modelled_notice_aware_s"]["p50"],
                0.1,
            )
        ]

    return _table(
        current, rows, live_label="liveness requests per interval per node, N={n}", after=notice
    )


def targets_42(current: list[dict[str, Any]]) -> list[list[Any]]:
    """Issue 42 item 5's table (node arrival: what one round costs the store), at 16,384 ranks
    (the largest size measured when it was not): each target, the value measured, met or
    not."""

    def rows(big: dict[str, Any], n: int) -> list[_Row]:
        return [
            (
                f"store requests per node per round, p50, N={n}",
                "<= 3",
                big["requests_per_node"]["p50"],
                3.0,
            ),
            (
                f"store server busy time per round p50, N={n}",
                "<= 0.2 s",
                big["server_busy_s"]["p50"],
                0.2,
            ),
            (
                f"modelled round time on a cluster p50, N={n}",
                "<= 0.35 s",
                big["modelled_round_s"]["p50"],
                0.35,
            ),
        ]

    return _table(current, rows, live_label="liveness requests per node per interval, N={n}")
