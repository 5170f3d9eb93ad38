"""The Wrapper's arguments: one keyword-only dataclass, checked when it is built
(the settings mechanism of :mod:`trainguard._settings`).

:class:`WrapperConfig` is the only place where the arguments are listed:
:class:`~trainguard.restart.Wrapper` takes exactly its fields (its signature and documentation
are derived from it), and every part of the restart machinery reads the checked, typed values
(timeouts as float seconds, the round policies as one :class:`RoundPolicies`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from trainguard import _settings
from trainguard._settings import PreemptionGrace, Seconds
from trainguard._timeouts import shorter
from trainguard.coord.store import parse_addr
from trainguard.errors import ConfigError
from trainguard.restart.policy._round import Policy, RoundPolicies
from trainguard.restart.policy.assignment import ShiftRanks
from trainguard.restart.policy.retry import RetryController
from trainguard.restart.quarantine import Quarantine
from trainguard.restart.state import RoundState
from trainguard.stragglers.config import Stragglers

__all__ = ["Hook", "StoreHandle", "WrapperConfig"]

#: a hook of the Wrapper (``initialize``, ``finalize``, ``health_check``, ``abort``).
Hook = Callable[[RoundState], object]


class StoreHandle(Protocol):
    """A store the user made (``torch.distributed.TCPStore``): the store process connects
    to ``host:port`` too, and each rank works on clones of it."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    def clone(self) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrapperConfig:
    """The arguments of :class:`~trainguard.restart.Wrapper`, checked (immutable).

    All are keyword-only; a bad one raises :class:`~trainguard.errors.ConfigError` naming the
    fix. Timeouts take seconds or a ``timedelta`` and read back as float seconds.

    Args:
        store: None (rank 0 starts a store process at MASTER_ADDR:MASTER_PORT, or the store
            named by ``TRAINGUARD_STORE_ADDR`` or torchrun's agent store is used), a
            ``"host:port"`` of an existing store, or a ``torch.distributed.TCPStore``.
        rank_assignment: ``Layout -> Layout`` (default :class:`ShiftRanks`).
        rank_filter: ``Layout -> Layout`` choosing the active ranks; the others are spares.
        initialize, finalize, health_check, abort: hooks ``RoundState -> None``. An exception
            from ``health_check`` or ``finalize`` removes this rank from the job (re-raised
            after it left cleanly); one from ``initialize`` is a fault of the round; ``abort``
            runs in the monitor thread after torch.distributed was aborted (the function may
            have been interrupted already).
        retry: a :class:`RetryController`; or ``max_rounds`` as a shorthand.
        max_repeated_faults: end the job (:class:`~trainguard.errors.RetryLimitError` on
            every rank) once this many rounds in a row failed with the same error raised at
            the same place with no progress between them (no ``call.ping()``, no checkpoint
            saved): a fault that restarting cannot cure. Default 3; None never ends the job
            for this.
        barrier_timeout: the longest a rank waits for the others at a round's barrier.
        completion_timeout: the longest a rank whose function returned waits for the others.
        store_timeout: timeout of connecting to the store and of single store operations.
        abort_timeout: how long a rank's function may stay blocked after its round was
            aborted; past it the rank leaves the job and its process ends (shorter than
            ``barrier_timeout``, so the others are not held at the next barrier).
        soft_timeout: no progress inside the function for this long (the main thread's
            position did not move, or no ``call.ping()`` once the function pinged) is a hang:
            the round is aborted and restarted, this rank included.
        hard_timeout: no progress for this long (or a thread holding the GIL so that no
            other thread runs): the sidecar kills the process (SIGTERM, then SIGKILL after
            ``termination_grace_time``) and the others go on without it.
        heartbeat_interval, heartbeat_timeout: each rank's sidecar beats in the store every
            interval; a rank whose beats stop for ``heartbeat_timeout`` (a lost node) is
            declared gone by the others' sidecars.
        sidecar: start the sidecar process (default True; False only for debugging: then
            deaths, hard hangs and lost nodes are not detected).
        stragglers: a :class:`~trainguard.stragglers.Stragglers` to find ranks that are alive
            but slow (None, the default: no measurement, ``call.section`` does nothing).
        preemption_grace: the budget from a SIGTERM to the end of the call, for stopping at an
            agreed step and saving it (:mod:`trainguard.restart.preempt`; None: the
            ``TRAINGUARD_PREEMPTION_GRACE`` variable, else 60 s). Read back as float seconds.
        quarantine: a :class:`~trainguard.restart.Quarantine`: take a host that keeps
            faulting out of the job and probe it before it comes back (None: faults are
            attributed to hosts in the events, nobody is taken out).

    Once built, ``rank_assignment`` is never None (:class:`ShiftRanks` by default), ``retry``
    holds the controller that ``max_rounds`` stands for, and :attr:`policies` bundles the
    three for whoever lays a round out.
    """

    store: str | StoreHandle | None = None
    rank_assignment: Policy | None = None
    rank_filter: Policy | None = None
    initialize: Hook | None = None
    finalize: Hook | None = None
    health_check: Hook | None = None
    abort: Hook | None = None
    retry: RetryController | None = None
    max_rounds: int | None = None
    max_repeated_faults: int | None = 3
    barrier_timeout: Seconds = Seconds(120)
    completion_timeout: Seconds = Seconds(120)
    store_timeout: Seconds = Seconds(60)
    abort_timeout: Seconds = Seconds(5)
    soft_timeout: Seconds = Seconds(60)
    hard_timeout: Seconds = Seconds(90)
    termination_grace_time: Seconds = Seconds(5)
    heartbeat_interval: Seconds = Seconds(1)
    heartbeat_timeout: Seconds = Seconds(10)
    sidecar: bool = True
    stragglers: Stragglers | None = None
    preemption_grace: PreemptionGrace = PreemptionGrace()
    quarantine: Quarantine | None = None
    #: rank assignment, rank filter and retry controller, as the round layout applies them.
    policies: RoundPolicies = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_store(self.store)
        self._check_order()
        if not isinstance(self.sidecar, bool):
            raise ConfigError(f"sidecar={self.sidecar!r}: pass True or False")
        if self.stragglers is not None and not isinstance(self.stragglers, Stragglers):
            raise ConfigError(
                f"stragglers={self.stragglers!r}: pass trainguard.stragglers.Stragglers(...)"
            )
        retry = self.retry
        if retry is not None and not isinstance(retry, RetryController):
            raise ConfigError(f"retry={retry!r}: pass a trainguard.restart.RetryController")
        if retry is not None and self.max_rounds is not None:
            raise ConfigError(
                "pass either max_rounds=... or retry=RetryController(...), not both: write "
                "retry=RetryController(max_rounds=..., min_active_world_size=...)"
            )
        if self.max_rounds is not None:
            retry = RetryController(max_rounds=self.max_rounds)
        for name in ("rank_assignment", "rank_filter", *_HOOKS):
            _check_callable(name, getattr(self, name))
        assignment = self.rank_assignment or ShiftRanks()
        object.__setattr__(self, "rank_assignment", assignment)
        object.__setattr__(self, "retry", retry)
        repeats = self.max_repeated_faults
        if repeats is not None and (type(repeats) is not int or repeats < 1):
            raise ConfigError(
                f"max_repeated_faults={repeats!r}: pass an int >= 1, or None to restart a fault "
                "that repeats without progress forever"
            )
        from trainguard import _env

        if self.quarantine is None and (spec := _env.settings().quarantine) is not None:
            object.__setattr__(self, "quarantine", Quarantine.from_launcher(spec))
        if self.quarantine is not None and not isinstance(self.quarantine, Quarantine):
            raise ConfigError(
                f"quarantine={self.quarantine!r}: pass trainguard.restart.Quarantine(after=..., "
                "window=...)"
            )
        policies = RoundPolicies(assignment, self.rank_filter, retry, repeats, self.quarantine)
        object.__setattr__(self, "policies", policies)

    def _check_order(self) -> None:
        """The timeouts' relations (each one alone was checked when it was set)."""
        barrier = self.barrier_timeout
        shorter(
            "store_timeout",
            self.store_timeout,
            "barrier_timeout",
            barrier,
            "a barrier includes store operations",
            equal=True,
        )
        shorter(
            "abort_timeout",
            self.abort_timeout,
            "barrier_timeout",
            barrier,
            "the others wait at the next barrier for a rank that is still being aborted",
        )
        soft, hard = self.soft_timeout, self.hard_timeout
        why = "the soft timeout restarts a hung rank in-process, the hard timeout kills it"
        shorter("soft_timeout", soft, "hard_timeout", hard, f"{why} when that failed")
        interval, beats = self.heartbeat_interval, self.heartbeat_timeout
        if interval >= beats:
            raise ConfigError(
                f"heartbeat_timeout={beats:g} s must be longer than heartbeat_interval="
                f"{interval:g} s (several intervals, so one late beat is not a verdict); raise "
                "heartbeat_timeout or lower heartbeat_interval"
            )
        if interval >= soft:
            raise ConfigError(
                f"heartbeat_interval={interval:g} s must be shorter than soft_timeout={soft:g} s; "
                "lower heartbeat_interval"
            )


_HOOKS = ("initialize", "finalize", "health_check", "abort")


def signature() -> inspect.Signature:
    """:class:`WrapperConfig`'s keyword arguments as a caller writes them (for ``help``)."""
    return _settings.signature(WrapperConfig)


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(
            f"{name}={value!r} is not callable; pass a policy such as "
            "trainguard.restart.ShiftRanks() or a function"
        )


def _check_store(store: object) -> None:
    if store is None or isinstance(store, str):
        if isinstance(store, str):
            try:
                parse_addr(store)
            except ConfigError as exc:
                raise ConfigError(f"store={store!r}: {exc}") from None
        return
    if not all(hasattr(store, a) for a in ("host", "port", "clone")):
        raise ConfigError(
            f"store={store!r}: pass a torch.distributed.TCPStore or 'host:port' (the store "
            "process must be able to connect to it too)"
        )
