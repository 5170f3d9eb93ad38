"""Quarantine: a host that keeps faulting is taken out of the job, and let back only once its
health probes pass.

    @tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(8),
        quarantine=tr.Quarantine(after=2, window=3600, file="/shared/exclude-hosts"),
    )
    def train(call: tr.CallWrapper): ...

The protocol, round by round:

1. Whoever lays round ``n`` out (:mod:`._book`) attributes the fault that ended round ``n-1``
   to the host of the rank that faulted first (:mod:`._attribution`) and adds it to the job's
   record (:mod:`._health`, published with the round). A cause raised on several hosts is a
   software bug and counts against none.
2. A host with ``after`` counted faults within ``window`` seconds is quarantined: its present
   ranks are excluded before the rank assignment runs, so they wait as spares and (with
   :class:`~trainguard.restart.FillGaps`) idle spares take their rank numbers. The job goes on
   at full active size while spares last, else shrinks within the rank filter's bounds, else
   ends with :class:`~trainguard.errors.HostQuarantinedError` naming the hosts and why.
3. Each rank of a quarantined host runs the probes (:mod:`.probes`, then ``health_check``)
   before each later barrier and puts the result in its barrier record; after ``readmit``
   consecutive rounds in which all its ranks passed, the host is back as a spare
   (``readmit=None`` or ``"never"``: it stays out for the rest of the job).
4. The first rank of each round (active rank 0) writes the quarantined hosts to ``file`` (one a line, the
   scheduler's exclude list), and emits ``fault_attributed``, ``host_quarantined`` and
   ``host_readmitted`` events.

Probes run only at barriers: an in-process job readmits a host at the rounds that follow
faults elsewhere (or never, if there are none; the file then still lists it).

Under ``trainguard launch --tg-quarantine-after N`` the workers' Wrapper gets its policy from
the launcher (``TRAINGUARD_QUARANTINE``, :meth:`Quarantine.from_launcher`, used when the Wrapper
has no ``quarantine=`` of its own) and shares a node-local directory with its agent: each rank
writes there whether its host is out (:meth:`Quarantine.tell_node`, on entering each round),
the agent stops respawning that node's workers and runs the probes every
``--tg-health-interval`` seconds, and the ranks' own probe at a barrier passes only once the
agent saw ``--tg-readmit-after`` consecutive passes (the file ``verdict`` says "ok").
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard._timeouts import Timeout, seconds
from trainguard.errors import ConfigError
from trainguard.restart.probes import FreeSpaceProbe, MatmulProbe, Probe, run_probes

__all__ = ["Quarantine"]


def _count(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"Quarantine({name}={value!r}): pass an int >= 1")
    return value


class Quarantine:
    """Take out a host with ``after`` attributed faults within ``window`` seconds.

    Args:
        after: how many faults on one host, within ``window``, take it out (>= 1).
        window: seconds (or a ``timedelta``) within which they count.
        readmit: consecutive passing probe rounds after which the host is back as a spare;
            None or ``"never"``: it stays out.
        probes: the built-in probes to run (default: :class:`~.probes.MatmulProbe` and
            :class:`~.probes.FreeSpaceProbe` on ``/dev/shm`` for 64 MiB).
        health_check: the user's own probes, callables ``RoundState -> object`` that raise
            when unhealthy (one or a sequence), run after ``probes``.
        probe_timeout: the longest one probe may run; past it, it failed.
        file: where the quarantined hosts are written, one a line (None: not written).
    """

    def __init__(
        self,
        after: int = 2,
        window: Timeout = 3600,
        *,
        readmit: int | str | None = 3,
        probes: Sequence[Probe] | None = None,
        health_check: Probe | Sequence[Probe] | None = None,
        probe_timeout: Timeout = 30,
        file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.after = _count("after", after)
        self.window = seconds("Quarantine(window)", window)
        if readmit == "never":
            readmit = None
        if readmit is not None and (type(readmit) is not int or readmit < 1):
            raise ConfigError(
                f"Quarantine(readmit={readmit!r}): pass an int >= 1 (passing probe rounds), or "
                "None / 'never' to keep a quarantined host out"
            )
        self.readmit = readmit
        self.probe_timeout = seconds("Quarantine(probe_timeout)", probe_timeout)
        default: Sequence[Probe] = (MatmulProbe(), FreeSpaceProbe("/dev/shm", 64 << 20))
        users: Sequence[Probe]
        if health_check is None:
            users = ()
        elif callable(health_check):
            users = (health_check,)
        else:
            users = tuple(health_check)
        self.probes: tuple[Probe, ...] = tuple(default if probes is None else probes) + tuple(users)
        for p in self.probes:
            if not callable(p):
                raise ConfigError(
                    f"Quarantine: probe {p!r} is not callable; pass probes such as "
                    "trainguard.restart.probes.FsyncProbe(root) or a function"
                )
        #: under ``trainguard launch``: the directory shared with this node's agent
        self.node_dir: Path | None = None
        self.file = None if file is None else Path(file)
        if self.file is not None and not self.file.parent.is_dir():
            raise ConfigError(
                f"Quarantine(file={str(self.file)!r}): its directory does not exist; create "
                "it or name a file in an existing directory"
            )

    @classmethod
    def from_launcher(cls, spec: dict[str, Any]) -> Quarantine:
        """The policy ``trainguard launch`` passed its workers (``TRAINGUARD_QUARANTINE``): the
        agent probes and counts the passes, so a rank's probe is the agent's verdict and one
        passing round readmits (``readmit`` None: never)."""
        readmit = None if spec["readmit"] is None else 1
        node_dir = Path(str(spec["node_dir"]))
        policy = cls(
            int(spec["after"]),
            float(spec["window"]),
            readmit=readmit,
            probes=[AgentVerdict(node_dir)],
            probe_timeout=float(spec["probe_timeout"]),
            file=None if spec["file"] is None else str(spec["file"]),
        )
        policy.node_dir = node_dir
        return policy

    def tell_node(self, host: str, out: bool, why: str) -> None:
        """Under the launcher: tell this node's agent whether ``host`` is out (each rank, on
        entering each round; the file is replaced whole). Without one: nothing."""
        if self.node_dir is None:
            return
        state = {"host": host, "out": out, "why": why, "time": time.time(), "pid": os.getpid()}
        _replace(self.node_dir / "state", json.dumps(state))

    def probe(self, state: object) -> str:
        """Run every probe on this rank (of a quarantined host): "ok" or the first failure."""
        return run_probes(self.probes, state, timeout=self.probe_timeout)

    def write(self, hosts: Sequence[str]) -> None:
        """Write ``hosts`` to :attr:`file`, one a line, replacing it whole (a reader never sees
        half a list)."""
        if self.file is not None:
            _replace(self.file, "".join(f"{h}\n" for h in hosts))

    def __getstate__(self) -> dict[str, Any]:
        # the sidecar lays rounds out with a pickled copy: it judges, it never probes (the
        # user's callables need not pickle)
        state = dict(self.__dict__)
        state["probes"] = ()
        return state

    def __repr__(self) -> str:
        return (
            f"Quarantine(after={self.after}, window={self.window:g}, readmit={self.readmit!r}, "
            f"probes={list(self.probes)!r}, file={str(self.file) if self.file else None!r})"
        )


class AgentVerdict:
    """A rank's probe under ``trainguard launch``: passes when the node's agent wrote "ok" to
    ``node_dir/verdict`` (its probes passed ``--tg-readmit-after`` times in a row)."""

    def __init__(self, node_dir: Path) -> None:
        self.node_dir = node_dir

    def __call__(self, state: object = None) -> None:
        try:
            verdict = (self.node_dir / "verdict").read_text().strip()
        except FileNotFoundError:
            verdict = "the node's agent has not probed this host yet"
        if verdict != "ok":
            raise RuntimeError(verdict)

    def __repr__(self) -> str:
        return "AgentVerdict()"


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half of it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
