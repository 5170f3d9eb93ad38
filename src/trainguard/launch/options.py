"""What ``trainguard launch`` adds to torchrun's options: :class:`LaunchOptions`.

Every field has a ``--tg-*`` flag (see ``trainguard launch --help``); the object is checked when
it is built (each field as it is set, then their relations), as every settings object of
trainguard is (:mod:`trainguard._settings`), and a bad value is a
:class:`~trainguard.errors.ConfigError` that names the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta

from trainguard._settings import TIMEOUT, Converted, PreemptionGrace, Seconds
from trainguard._timeouts import Timeout, seconds, shorter
from trainguard.errors import ConfigError

__all__ = ["ON_EVICTED", "LaunchOptions"]

#: the values of ``on_evicted`` (``--tg-on-evicted``)
ON_EVICTED = ("rejoin", "exit")


def _backoff(name: str, value: Timeout) -> float:
    """``respawn_backoff`` may be 0 (respawn at once), unlike a timeout."""
    zero = timedelta(0) if isinstance(value, timedelta) else 0
    if not isinstance(value, bool) and value == zero:
        return 0.0
    return seconds(name, value)


def _count(name: str, value: object, zero: str) -> int:
    """A whole number >= 0 (``zero``: what 0 means), or the error naming its flag."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 0 (0: {zero}); pass {_flag(name)} N"
        )
    return value


def _counter(zero: str) -> Callable[[str, int], int]:
    """The converter of a count field whose 0 means ``zero``."""
    return lambda name, value: _count(name, value, zero)


def _flag(name: str) -> str:
    return "--tg-" + name.replace("_", "-")


def _store(name: str, store: str | tuple[str, int] | None) -> tuple[str, int] | None:
    if store is None or isinstance(store, tuple):
        return store
    from trainguard.coord.store import parse_addr

    return parse_addr(store)


def _path(what: str) -> Callable[[str, str | None], str | None]:
    """The converter of a path field (``what`` it must be); "" is None."""

    def convert(name: str, value: str | None) -> str | None:
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be {what} (a str)")
        return value or None

    return convert


def _evicted(name: str, value: str) -> str:
    if value not in ON_EVICTED:
        raise ConfigError(
            f"{name}={value!r}: pass --tg-on-evicted rejoin (take a free place again) or exit "
            "(leave the job)"
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """Settings of the trainguard agent, on top of torchrun's.

    Args:
        store: ``"host:port"`` of an external coordination store (``--tg-store``); ``None``:
            the agent of group rank 0 hosts one for its lifetime.
        respawns: how many times one worker slot is respawned per generation before the
            launcher restarts the whole job (``--tg-respawns``).
        respawn_backoff: delay before a slot's first respawn; later respawns of the same slot
            wait twice as long each time, from 0.5 s when this is 0 (``--tg-respawn-backoff``).
        rejoin_timeout: how long the survivors wait for a respawned worker before they go on
            without it (``--tg-rejoin-timeout``).
        heartbeat_interval, heartbeat_timeout: one heartbeat per node every interval; a node
            silent for the timeout is lost (``--tg-heartbeat-interval``, ``--tg-heartbeat-timeout``).
        exit_barrier_timeout: how long an agent whose workers all finished waits for the other
            agents (``--tg-exit-barrier-timeout``; torch's own default is 300 s).
        events_dir: directory of the event log of the agents and workers (``--tg-events-dir``;
            default ``TRAINGUARD_EVENTS_DIR``).
        on_evicted: what a node that was declared lost (cut off, or too slow) does once it
            reaches the store again: ``"rejoin"`` (default: it takes a free place of the job
            as a new node, its workers admitted at a round boundary) or ``"exit"`` (it leaves
            the job: exit status 3) (``--tg-on-evicted``).
        secret_file: a file (mode 600, the same on every node) whose first line is the job
            secret (``--tg-secret-file``; default ``TRAINGUARD_JOB_SECRET``). A job on several
            hosts needs a secret (:mod:`trainguard.launch._jobsecret`).
        insecure: let a job on several hosts run without one (``--tg-insecure``).
        fence_timeout: how long a node that fenced itself (it could not reach the coordination
            store) waits for the store before it leaves the job (``--tg-fence-timeout``,
            default 300 s).
        preemption_grace: the budget of a preemption: the seconds from a SIGTERM to the end of
            the workers, which stop at an agreed step and save it; the agent kills them this
            long (plus 5 s) after forwarding the signal (``--tg-preemption-grace``; default
            ``TRAINGUARD_PREEMPTION_GRACE``, else 60 s). The workers get it in their
            ``TRAINGUARD_PREEMPTION_GRACE``.
        warm_workers: processes per node started ahead and past their imports (torch,
            trainguard, the script's installed imports), waiting: a respawn hands one the dead
            worker's identity instead of starting a process cold (``--tg-warm-workers``;
            default 0, see :mod:`trainguard.launch._warm`).
        quarantine_after, quarantine_window: a host with this many attributed faults within
            the window (seconds) is taken out of the job (``--tg-quarantine-after``, default 0:
            off; ``--tg-quarantine-window``, default 3600), the policy of
            :class:`~trainguard.restart.Quarantine`, given to the workers' Wrapper; see
            :mod:`trainguard.launch._quarantine`.
        quarantine_file: where the quarantined hosts are written, one a line
            (``--tg-quarantine-file``).
        health_interval: seconds between two probe rounds of a quarantined node's agent
            (``--tg-health-interval``, default 60).
        readmit_after: consecutive passing probe rounds after which the host is back as a
            spare (``--tg-readmit-after``, default 3); ``readmit="never"`` keeps it out
            (``--tg-readmit never``; default ``"after"``).
        health_check: a shell command run as one more probe; exit status 0 passes
            (``--tg-health-check``).
        probe_timeout: the longest one probe may run (``--tg-probe-timeout``, default 30).

    Timeouts are keyword-only, in seconds or as a ``timedelta``.
    """

    store: Converted[str | tuple[str, int] | None, tuple[str, int] | None] = Converted(None, _store)
    respawns: Converted[int, int] = Converted(3, _counter("every worker death restarts the job"))
    respawn_backoff: Converted[Timeout, float] = Converted(0.0, _backoff, written=TIMEOUT)
    rejoin_timeout: Seconds = Seconds(60.0)
    heartbeat_interval: Seconds = Seconds(1.0)
    heartbeat_timeout: Seconds = Seconds(10.0)
    exit_barrier_timeout: Seconds = Seconds(30.0)
    events_dir: Converted[str | None, str | None] = Converted(None, _path("a directory path"))
    on_evicted: Converted[str, str] = Converted("rejoin", _evicted)
    fence_timeout: Seconds = Seconds(300.0)
    secret_file: Converted[str | None, str | None] = Converted(None, _path("a file path"))
    insecure: bool = False
    preemption_grace: PreemptionGrace = PreemptionGrace()
    warm_workers: Converted[int, int] = Converted(0, _counter("respawns start cold"))
    quarantine_after: Converted[int, int] = Converted(0, _counter("no host is ever taken out"))
    quarantine_window: Seconds = Seconds(3600.0)
    quarantine_file: Converted[str | None, str | None] = Converted(None, _path("a file path"))
    health_interval: Seconds = Seconds(60.0)
    readmit_after: int = 3
    readmit: str = "after"
    health_check: str | None = None
    probe_timeout: Seconds = Seconds(30.0)

    def __post_init__(self) -> None:
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"insecure={self.insecure!r}: pass True or False (--tg-insecure)")
        if self.respawn_backoff:
            shorter(
                "respawn_backoff",
                self.respawn_backoff,
                "rejoin_timeout",
                self.rejoin_timeout,
                "a worker respawned after the survivors stopped waiting for it is counted out",
            )
        shorter(
            "heartbeat_interval",
            self.heartbeat_interval,
            "heartbeat_timeout",
            self.heartbeat_timeout,
            "a node must be able to miss a heartbeat before it is declared lost",
        )
        shorter(
            "heartbeat_timeout",
            self.heartbeat_timeout,
            "fence_timeout",
            self.fence_timeout,
            "a node cut off from the store waits at least one heartbeat timeout for it",
        )
        self._check_quarantine()

    def _check_quarantine(self) -> None:
        """The quarantine fields, checked by :class:`~trainguard.restart.Quarantine` itself
        (the same policy as the Wrapper's) and named by their flags."""
        from trainguard.restart.quarantine import Quarantine

        readmit, readmit_after, check = self.readmit, self.readmit_after, self.health_check
        if readmit not in ("after", "never"):
            raise ConfigError(
                f"readmit={readmit!r}: pass --tg-readmit after (back after --tg-readmit-after "
                "passing probe rounds) or never (a quarantined host stays out)"
            )
        if (
            isinstance(readmit_after, bool)
            or not isinstance(readmit_after, int)
            or readmit_after < 1
        ):
            raise ConfigError(
                f"readmit_after={readmit_after!r} must be a whole number >= 1 (consecutive "
                "passing probe rounds); pass --tg-readmit-after K, or --tg-readmit never"
            )
        if check is not None and (not isinstance(check, str) or not check):
            raise ConfigError(
                f"health_check={check!r}: pass --tg-health-check 'COMMAND' (a shell command "
                "whose exit status 0 means the host is healthy)"
            )
        try:  # the same checks as the Wrapper's policy
            Quarantine(
                max(self.quarantine_after, 1),
                self.quarantine_window,
                readmit=readmit_after,
                probes=[],
                probe_timeout=self.probe_timeout,
                file=self.quarantine_file,
            )
        except ConfigError as exc:
            flags = "--tg-quarantine-window, --tg-probe-timeout, --tg-quarantine-file"
            raise ConfigError(f"{exc} (the launcher's flags: {flags})") from None
        if (self.quarantine_file or check) and not self.quarantine_after:
            raise ConfigError(
                "--tg-quarantine-file and --tg-health-check need a quarantine: pass "
                "--tg-quarantine-after N (N >= 1 faults take a host out)"
            )
