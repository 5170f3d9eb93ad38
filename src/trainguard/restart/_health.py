"""The job's record of which hosts fault, which are quarantined, and how their probes went.

Kept by whoever lays a round out (:mod:`._book`) and published with the round (the layout's
``health``), so that the next round's writer, whichever rank or sidecar it is, continues it, as
:mod:`._repeat` does for repeated faults. One JSON object:

- ``hosts``: host -> the initial ranks seen on it (a gone rank's host is found here);
- ``seen``: ``[host, cause, time, blamed]`` for each fault within the window: the round's
  attributed fault (``blamed``) and the causes the other ranks raised in that round;
- ``out``: quarantined host -> ``{"since", "why", "passes", "causes"}`` (consecutive passing
  probes; the causes that took it out);
- ``blame``: the fault that ended the round before, attributed (:class:`~._attribution.Blame`);
- ``new``, ``back``, ``freed``: the hosts taken out, readmitted (their probes passed), and let
  go (their causes were seen on other hosts since) at this round.

A cause seen on two or more hosts within the window is a software bug: it counts against no
host (the repeat detection, ``max_repeated_faults``, still ends a job that keeps failing so).
That may become clear only after a host was taken out for it: the ranks elsewhere may have
been interrupted by the first rank's fault before they reached the same error. A quarantined
host all of whose causes were seen on another host since is let go (``freed``): it was the
software, not the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.restart._attribution import Blame, blame_of, is_collective
from trainguard.restart._records import BarrierRecord
from trainguard.restart.state import RoundOutcome

__all__ = ["Health", "Verdict", "judge_round", "quarantined"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One round's judgement: the new state, the hosts taken out and readmitted."""

    health: Health
    new: tuple[str, ...]
    back: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Health:
    """The published state (see the module docstring); immutable, :meth:`judge` returns a new one."""

    hosts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    seen: tuple[tuple[str, str, float, bool], ...] = ()
    out: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    blame: Blame | None = None
    new: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    freed: tuple[str, ...] = ()

    def software(self) -> set[str]:
        """The causes seen on more than one host (within the window)."""
        hosts: dict[str, set[str]] = {}
        for host, cause, _, _ in self.seen:
            hosts.setdefault(cause, set()).add(host)
        return {cause for cause, on in hosts.items() if len(on) > 1}

    def counted(self, host: str) -> list[str]:
        """The causes of the faults that count against ``host`` (blamed, not software)."""
        software = self.software()
        return [c for h, c, _, blamed in self.seen if h == host and blamed and c not in software]

    def host_of(self, rank: int) -> str:
        for host, ranks in self.hosts.items():
            if rank in ranks:
                return host
        return ""

    def judge(
        self,
        *,
        after: int,
        window: float,
        readmit_after: int | None,
        now: float,
        blame: Blame | None,
        raised: Mapping[str, set[str]],
        probes: Mapping[str, list[str | None]],
        info: Mapping[int, str],
    ) -> Verdict:
        """The state after one round: ``blame`` (its fault, attributed), ``raised`` (host ->
        causes its ranks raised), ``probes`` (quarantined host -> its present ranks' probe
        results: "ok", a failure, None when none ran), ``info`` (present rank -> host)."""
        owner = {r: h for h, rs in self.hosts.items() for r in rs}
        owner.update(info)  # where each rank is now (a respawned rank may have moved)
        hosts: dict[str, set[int]] = {}
        for r, host in owner.items():
            hosts.setdefault(host, set()).add(r)
        seen = [s for s in self.seen if s[2] >= now - window]
        for host, causes in raised.items():
            seen.extend((host, cause, now, False) for cause in sorted(causes))
        if blame is not None and blame.host:
            seen.append((blame.host, blame.cause, blame.time, True))
        out = {h: dict(v) for h, v in self.out.items()}
        back = self._probed(out, probes, readmit_after)
        freed = _freed(out, seen)  # their causes go back into seen: they count against none
        state = dataclasses.replace(self, seen=tuple(seen))
        new = []
        if blame is not None and blame.host and blame.host not in out:
            counted = state.counted(blame.host)
            blame = dataclasses.replace(blame, counted=blame.cause in counted)
            if len(counted) >= after:
                new.append(blame.host)
                took = sorted(set(counted))
                why = f"{len(counted)} faults within {window:g} s ({', '.join(took)})"
                out[blame.host] = {"since": now, "why": why, "passes": 0, "causes": took}
        elif blame is not None:
            blame = dataclasses.replace(blame, counted=False)
        cleared = set(new) | set(back)  # a host starts afresh once out or back
        seen = [s for s in seen if s[0] not in cleared or not s[3]]
        health = Health(
            hosts={h: tuple(sorted(rs)) for h, rs in sorted(hosts.items()) if rs},
            seen=tuple(seen),
            out=out,
            blame=blame,
            new=tuple(new),
            back=tuple(back),
            freed=tuple(freed),
        )
        return Verdict(health, tuple(new), tuple(back))

    @staticmethod
    def _probed(
        out: dict[str, dict[str, Any]],
        probes: Mapping[str, list[str | None]],
        readmit_after: int | None,
    ) -> list[str]:
        back = []
        for host, state in out.items():
            results = [p for p in probes.get(host, []) if p is not None]
            if not results:
                continue  # no probe ran on it this round (none of its ranks was out yet)
            failed = [p for p in results if p != "ok"]
            state["passes"] = 0 if failed else int(state.get("passes", 0)) + 1
            if failed:
                state["failed"] = failed[0][:300]
            if readmit_after is not None and state["passes"] >= readmit_after:
                back.append(host)
        for host in back:
            del out[host]
        return back

    def encode(self) -> dict[str, Any]:
        return {
            "hosts": {h: list(rs) for h, rs in self.hosts.items()},
            "seen": [list(s) for s in self.seen],
            "out": {h: dict(v) for h, v in self.out.items()},
            "blame": self.blame.encode() if self.blame is not None else None,
            "new": list(self.new),
            "back": list(self.back),
            "freed": list(self.freed),
        }

    @classmethod
    def decode(cls, value: object) -> Health:
        """Back from :meth:`encode`; what is malformed is left out (never raises)."""
        if not isinstance(value, dict):
            return cls()
        hosts = value.get("hosts")
        seen = value.get("seen")
        out = value.get("out")
        return cls(
            hosts={
                h: tuple(r for r in rs if type(r) is int)
                for h, rs in (hosts.items() if isinstance(hosts, dict) else ())
                if isinstance(rs, list)
            },
            seen=tuple(
                (s[0], s[1], float(s[2]), bool(s[3]))
                for s in (seen if isinstance(seen, list) else ())
                if isinstance(s, list)
                and len(s) == 4
                and isinstance(s[0], str)
                and isinstance(s[1], str)
                and type(s[2]) in (int, float)
            ),
            out={
                h: dict(v)
                for h, v in (out.items() if isinstance(out, dict) else ())
                if isinstance(v, dict)
            },
            blame=Blame.decode(value.get("blame")),
            new=_strings(value.get("new")),
            back=_strings(value.get("back")),
            freed=_strings(value.get("freed")),
        )


def _freed(out: dict[str, dict[str, Any]], seen: list[tuple[str, str, float, bool]]) -> list[str]:
    """Let go of (remove from ``out``, return) the quarantined hosts all of whose causes were
    seen on another host within the window (``seen``): a software bug, not the host. Their
    causes are added to ``seen`` (not blamed), so that they count against no host from now."""
    freed = []
    for host, state in out.items():
        causes = _strings(state.get("causes"))
        if causes and all(any(h != host and c == cause for h, c, _, _ in seen) for cause in causes):
            freed.append(host)
            since = float(state.get("since", 0.0))
            seen.extend((host, cause, since, False) for cause in causes)
    for host in freed:
        del out[host]
    return freed


def _strings(value: object) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def judge_round(
    previous: Mapping[str, Any] | None,
    quarantine: Any,
    outcome: RoundOutcome | None,
    records: Mapping[int, BarrierRecord | None],
    info: Mapping[int, Mapping[str, str]],
    now: float,
    *,
    died: Mapping[int, str] | None = None,
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """Run by whoever lays a round out: the round's ``health`` to publish, and the present
    ranks to exclude (those of quarantined hosts). ``previous``: the last round's health;
    ``outcome``: how the last round ended; ``records``: this barrier's; ``info``: present
    rank -> its facts (``host``); ``died``: the ranks whose death notice this barrier holds
    (gone during the last round) -> the host they were last seen on ("" when not known). Without a quarantine only the attribution is kept.

    A death is the round's fault even when another rank's proposal won the stop key: the
    survivors' collectives fail as soon as the dead rank's connections close, and their
    error may reach the store before the death notice does. Blaming the survivor would count
    a healthy host (and, on one host, a software "cause" inside torch) for a dead peer."""
    state = Health.decode(previous)
    hosts = {r: facts.get("host", "") for r, facts in info.items()}
    died = died or {}
    outcome = _death_first(outcome, sorted(died))
    rank = outcome.rank if outcome is not None else None
    host = (hosts.get(rank) or died.get(rank, "")) if rank is not None else ""
    blame = blame_of(outcome, host or (state.host_of(rank) if rank is not None else ""))
    blame = _root_first(blame, records, hosts)
    if quarantine is None:
        return ({"blame": blame.encode()} if blame is not None else {}), ()
    raised: dict[str, set[str]] = {}
    probes: dict[str, list[str | None]] = {}
    for r, rec in records.items():
        if rec is None or r not in hosts:
            continue
        if rec.raised:
            raised.setdefault(hosts[r], set()).add(rec.raised)
        if hosts[r] in state.out:
            probes.setdefault(hosts[r], []).append(rec.probe)
    verdict = state.judge(
        after=quarantine.after,
        window=quarantine.window,
        readmit_after=quarantine.readmit,
        now=now,
        blame=blame,
        raised=raised,
        probes=probes,
        info=hosts,
    )
    out = verdict.health.out
    excluded = tuple(sorted(r for r, h in hosts.items() if h in out))
    return verdict.health.encode(), excluded


def _death_first(outcome: RoundOutcome | None, died: Sequence[int]) -> RoundOutcome | None:
    """The round's outcome with a death in it put first (see :func:`judge_round`)."""
    if outcome is None or outcome.why != "fault" or not died or outcome.rank in died:
        return outcome
    # no frames in it: the survivor's place is not the death's
    error = f"rank {died[0]} died; rank {outcome.rank}'s {outcome.type or 'fault'} came first"
    return dataclasses.replace(outcome, rank=died[0], type="RankGone", error=error)


def _root_first(
    blame: Blame | None, records: Mapping[int, BarrierRecord | None], hosts: Mapping[int, str]
) -> Blame | None:
    """A failed collective that won the round's stop key gives way to the exception of its
    own that another rank raised in the same round: a rank that raises and then leaves the
    group (``finally: destroy_process_group()``) closes its connections before its error
    reaches the store, and its peers' collectives fail first."""
    if blame is None or not is_collective(blame.cause):
        return blame
    roots = sorted(
        (r, rec.raised)
        for r, rec in records.items()
        if rec is not None and rec.raised and r != blame.rank and not is_collective(rec.raised)
    )
    if not roots:
        return blame
    r, cause = roots[0]
    host = hosts.get(r, "")
    kind = cause.partition(" @ ")[0]
    return Blame(r, host, kind, cause, blame.time, counted=bool(host))


def quarantined(health: Mapping[str, Any] | None) -> dict[str, str]:
    """The quarantined hosts in a published round's ``health`` -> why."""
    out = Health.decode(health).out
    return {h: str(v.get("why", "")) for h, v in sorted(out.items())}


def ended(why: str, health: Mapping[str, Any]) -> str:
    """The end of a job that the filter or retry controller stopped (``why``), naming the
    quarantined hosts when there are any (the ranks then raise HostQuarantinedError)."""
    out = quarantined(health)
    if not out:
        return why
    hosts = "; ".join(f"{h}: {v}" for h, v in out.items())
    return f"{why}; {QUARANTINED} {hosts}"


#: the words of an end caused by a quarantine (the ranks raise HostQuarantinedError on them).
QUARANTINED = "with these hosts quarantined:"
