"""The Wrapper (decorator) and the CallWrapper handed to the wrapped function.

Protocol of one call of the wrapped function, on every rank (each rank calls it once, like
any SPMD function):

1. Rank 0 starts the store process; every rank connects to the coordination store and starts
   its monitor thread (:mod:`.monitor`).
2. Round ``n``: health check → barrier of the ranks still in the job → the last arriver lays
   the round out (rank assignment, rank filter, retry controller) → each rank sets RANK,
   WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for the round's own store → ``initialize``
   → active ranks run the function, spares wait.
3. A function that raises records a fault (the round's outcome, first writer wins); every
   rank's monitor interrupts the function and aborts torch.distributed; each rank runs
   ``finalize`` and ``health_check`` and goes to round ``n+1``. A rank whose ``finalize`` or
   ``health_check`` raised leaves the job at that barrier and re-raises the error.
4. When every active rank's function returned, the round is complete: active ranks return
   their function's value, spares return None, and the environment is restored.
5. ``KeyboardInterrupt``/``SystemExit`` (any ``BaseException`` that is not ours) ends the job:
   that rank re-raises it, every other rank raises :class:`JobEndedError`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
import typing
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainguard import events
from trainguard.coord.store import connect, parse_addr
from trainguard.errors import (
    BarrierTimeoutError,
    ConfigError,
    JobEndedError,
    RetryLimitError,
    SidecarLostError,
)
from trainguard.restart import _launch
from trainguard.restart._session import Session
from trainguard.restart.abort import GroupSockets, destroy_groups
from trainguard.restart.config import WrapperConfig
from trainguard.restart.config import signature as config_signature
from trainguard.restart.monitor import Monitor
from trainguard.restart.sidecar import Sidecar, SidecarConfig
from trainguard.restart.state import RestartInterrupt, RoundOutcome, RoundState, describe
from trainguard.restart.watchdog import Watchdog

__all__ = ["CallWrapper", "Wrapper"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
S = TypeVar("S")

_call_counter = itertools.count()
_active_calls = threading.local()


class CallWrapper:
    """Handed to the wrapped function (declare a parameter annotated ``CallWrapper``).

    Attributes ``round``, ``rank``, ``world_size``, ``initial_rank``, ``initial_world_size``
    describe the current round; :attr:`state` is the full :class:`RoundState`.
    """

    def __init__(self, state: RoundState, monitor: Monitor, pg_addr: str, timeout: float):
        self.state = state
        self._monitor = monitor
        self._pg_addr = pg_addr
        self._timeout = timeout
        self._store: Any = None
        self.pings = 0
        self.last_ping = time.monotonic()

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def rank(self) -> int:
        assert self.state.rank is not None
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def initial_rank(self) -> int:
        return self.state.initial_rank

    @property
    def initial_world_size(self) -> int:
        return self.state.initial_world_size

    @property
    def store(self) -> Any:
        """A client of this round's own store (fresh each round; dropped when it ends).

        For ``init_process_group(backend, store=call.store, rank=call.rank,
        world_size=call.world_size)``.
        """
        if self._store is None:
            host, port = parse_addr(self._pg_addr)
            self._store = connect(host, port, timeout=self._timeout)
        return self._store

    def ping(self) -> None:
        """Report progress (cheap; the hang detection of a later release reads it)."""
        self.pings += 1
        self.last_ping = time.monotonic()

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A block that a restart never interrupts: the abort waits until it ends.

        Keep it short, and never wait on other ranks inside it (their fault would leave this
        rank waiting with nothing to release it).
        """
        return self._monitor.atomic()

    def _close(self) -> None:
        self._store = None


_NO_KICK: Any = object()


def _noop(signum: int, frame: Any) -> None:
    """Runs Python code in the main thread so that a pending restart interrupt is raised."""


def _install_kick() -> Any:
    """SIGUSR2 wakes the main thread from a blocking call (``time.sleep``...)."""
    if threading.current_thread() is not threading.main_thread():
        return _NO_KICK
    return signal.signal(signal.SIGUSR2, _noop)


def _restore_kick(old: Any) -> None:
    if old is not _NO_KICK:
        signal.signal(signal.SIGUSR2, old if old is not None else signal.SIG_DFL)


def _kick(thread_id: int) -> None:
    signal.pthread_kill(thread_id, signal.SIGUSR2)


def _arguments_of(
    config: Callable[P, WrapperConfig],
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """``__init__(self, **kwargs)`` takes ``config``'s keyword arguments: for type checkers
    (``P``) and for ``inspect.signature``/``help`` (``__signature__``)."""

    def give(init: Callable[Concatenate[S, ...], None]) -> Callable[Concatenate[S, P], None]:
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = config_signature().parameters.values()
        init.__signature__ = inspect.Signature([this, *params], return_annotation=None)  # type: ignore[attr-defined]
        return init

    return give


def _call_param(fn: Callable[..., Any]) -> str | None:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for name, param in inspect.signature(fn).parameters.items():
        ann = hints.get(name, param.annotation)
        if ann is CallWrapper or (isinstance(ann, str) and ann.split(".")[-1] == "CallWrapper"):
            return name
    return None


class Wrapper:
    """Decorator: restart the function in-process, on every rank, whenever any rank faults.

    ``Wrapper(**arguments)`` takes the fields of :class:`WrapperConfig` as keyword arguments
    and checks them at once (:attr:`config`); the decorated function, called on every rank,
    runs the protocol of :mod:`trainguard.restart.wrapper`.
    """

    @_arguments_of(WrapperConfig)
    def __init__(self, **kwargs: Any) -> None:
        self.config = WrapperConfig(**kwargs)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``fn``; the wrapped function takes ``fn``'s arguments but its CallWrapper."""
        if not callable(fn):
            raise ConfigError(f"Wrapper(...) decorates a function, got {fn!r}")
        param = _call_param(fn)
        config = self.config

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if param is not None and param in kwargs:
                raise ConfigError(f"do not pass {param!r}: the Wrapper provides the CallWrapper")
            if getattr(_active_calls, "on", False):
                raise ConfigError("a wrapped function cannot call a wrapped function")
            _active_calls.on = True
            try:
                return _Run(config, fn, param, args, kwargs).run()
            finally:
                _active_calls.on = False

        return wrapped


# help(Wrapper) documents the arguments with the text written where they are defined.
_, _, _arguments_doc = (WrapperConfig.__doc__ or "").partition("\n")
Wrapper.__doc__ = f"{Wrapper.__doc__ or ''}{_arguments_doc}"


class _Run:
    """One call of a wrapped function on this rank."""

    def __init__(
        self,
        cfg: WrapperConfig,
        fn: Callable[..., Any],
        param: str | None,
        args: Any,
        kwargs: Any,
    ) -> None:
        self.cfg, self.fn, self.param, self.args, self.kwargs = cfg, fn, param, args, kwargs
        self.launch = _launch.detect()
        self.session = Session(self.launch, next(_call_counter), cfg)
        self.monitor: Monitor | None = None
        self.sidecar: Sidecar | None = None
        self.watchdog: Watchdog | None = None
        self.call: CallWrapper | None = None
        self.left_early = False
        self.state = RoundState(
            round=0, initial_rank=self.launch.rank, initial_world_size=self.launch.world_size
        )

    # the call -----------------------------------------------------------------------------
    def run(self) -> Any:
        start = time.monotonic()
        log = events.get_log()
        saved_context = (log.rank, log.round)
        events.set_context(rank=self.launch.rank, round=0)
        GroupSockets.install()
        finished = False
        old_handler = _install_kick()
        try:
            self.session.open()
            if self.cfg.sidecar:
                self.sidecar = self._start_sidecar(log.directory)
            self.monitor = Monitor(
                self.session.watch_store,
                self.session.keys,
                threading.get_ident(),
                on_abort=self._abort_hook,
                abort_timeout=self.cfg.abort_timeout,
                on_stuck=self._stuck,
                kick=_kick if old_handler is not _NO_KICK else None,
            )
            if self.sidecar is not None:
                self.sidecar.handshake(self.cfg.store_timeout)
            hang_store = self.session.coord.clone()
            self.watchdog = Watchdog(
                thread_id=threading.get_ident(),
                state=self._progress_state,
                on_hang=lambda n, why: self._hang(hang_store, n, why),
                soft_timeout=self.cfg.soft_timeout,
                interval=min(0.1, self.cfg.soft_timeout / 20),
                sidecar=self.sidecar,
            )
            value = self._rounds()
            finished = True
            events.emit("complete", duration=time.monotonic() - start, rounds=self.state.round + 1)
            return value
        except BaseException:
            # Make sure the others learn that this rank is gone from the round it was in.
            if self.monitor is not None and self.monitor.outcome is None:
                with contextlib.suppress(Exception):
                    self.session.stop(
                        self.state.round,
                        RoundOutcome.end("left with an error", rank=self.launch.rank),
                    )
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            if self.monitor is not None:
                self.monitor.close()
            destroy_groups()
            GroupSockets.uninstall()
            self.session.leave()
            if self.sidecar is not None:
                self.sidecar.stop()
                self.sidecar = None
            _restore_kick(old_handler)
            self.session.close(
                early=self.left_early,
                timeout=self.cfg.barrier_timeout
                if finished
                else min(10.0, self.cfg.barrier_timeout),
            )
            self.monitor = None
            log.rank, log.round = saved_context

    def _rounds(self) -> Any:
        leaving: BaseException | None = None
        fault: str | None = None
        leaving = self._hook("health_check", self.state)
        n = 0
        while True:
            ready = self.session.barrier(
                n, leaving=describe(leaving) if leaving else None, fault=fault
            )
            if ready is None:
                assert leaving is not None
                self.left_early = True
                raise leaving
            self.state = self._state(n, ready)
            if self.sidecar is not None:
                self.sidecar.send({"round": n, "roster": list(self.session.roster)})
            events.set_context(round=n)
            if ready["end"]:
                causes = {**self.state.gone, **self.state.faults}
                lost = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.state.gone.items()))
                raise RetryLimitError(
                    ready["end"] + (f"; ranks lost: {lost}" if lost else ""), causes=causes
                )
            events.emit(
                "round_start",
                active=list(self.state.active_ranks),
                spares=list(self.state.spare_ranks),
                rank_in_round=self.state.rank,
                world_size=self.state.world_size,
            )
            outcome, value, fault = self._round(n, ready)
            if outcome.why == "complete":
                error = self._hook("finalize", self.state)
                if error is not None:
                    raise error
                return value if self.state.active else None
            if outcome.why == "end":
                rank = outcome.rank
                reason = outcome.reason or outcome.error or ""
                raise JobEndedError(
                    f"the job ended in round {n}: rank {rank} {reason}; not restarted",
                    causes={rank: reason} if rank is not None else None,
                )
            destroy_groups()
            GroupSockets.take()
            self.state = self.state.replace(
                faults={outcome.rank if outcome.rank is not None else -1: outcome.error or ""}
            )
            leaving = (
                self._hook("finalize", self.state)
                or self._hook("health_check", self.state)
                or self._sidecar_lost()
            )
            n += 1

    def _state(self, n: int, ready: dict[str, Any]) -> RoundState:
        active = tuple(ready["active"])
        irank = self.launch.rank
        return RoundState(
            round=n,
            initial_rank=irank,
            initial_world_size=self.launch.world_size,
            rank=active.index(irank) if irank in active else None,
            world_size=len(active),
            active_ranks=active,
            spare_ranks=tuple(ready["spare"]),
            gone={int(k): v for k, v in ready["gone"].items()},
            faults={int(k): v for k, v in ready["faults"].items()},
        )

    def _hook(self, name: str, state: RoundState) -> BaseException | None:
        hook = getattr(self.cfg, name)
        if hook is None:
            return None
        try:
            hook(state)
        except Exception as exc:
            logger.error("rank %d: %s raised %s; leaving the job", state.initial_rank, name, exc)
            events.emit(f"{name}_failed", error=describe(exc))
            return exc
        return None

    def _start_sidecar(self, log_dir: Any) -> Sidecar:
        session = self.session
        assert session.coord_addr is not None
        config = SidecarConfig.build(
            self.cfg,
            rank=self.launch.rank,
            world=self.launch.world_size,
            keys=session.keys,
            addr=session.coord_addr,
            log_dir=log_dir,
        )
        return Sidecar(config).start()

    def _progress_state(self) -> tuple[int, bool, Any]:
        monitor = self.monitor
        return self.state.round, bool(monitor is not None and monitor._in_fn), self.call

    def _hang(self, store: Any, n: int, why: str) -> None:
        """Watchdog thread: record a hang (or the sidecar's loss) as round ``n``'s fault."""
        kind = "Hang" if why.startswith("hang") else "SidecarLost"
        outcome = RoundOutcome.fault(self.launch.rank, why, kind)
        try:
            store.compare_set(self.session.keys.stop(n), "", outcome.encode())
        except Exception as exc:
            logger.error("could not record the fault %r: %s", why, exc)

    def _sidecar_lost(self) -> BaseException | None:
        lost = self.watchdog.lost if self.watchdog is not None else None
        if lost is None:
            return None
        return SidecarLostError(
            f"rank {self.launch.rank}: {lost}; it left the job rather than run without "
            "protection (see its sidecar-<rank>.log in the events directory or tmp)",
            causes={self.launch.rank: lost},
        )

    def _stuck(self, n: int) -> None:
        """Monitor thread: the main thread did not leave the function after the abort.

        This rank leaves the job at round ``n+1``'s barrier (so the others go on without it)
        and its process ends: a thread blocked in the collective library cannot be recovered.
        """
        frame = sys._current_frames().get(self.monitor._tid if self.monitor else 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        reason = (
            f"still blocked in the function {self.cfg.abort_timeout:g} s after the abort of "
            "round {n}; the process ends"
        ).replace("{n}", str(n))
        logger.error("rank %d: %s; main thread at:\n%s", self.launch.rank, reason, stack)
        events.emit("abort_stuck", stack=stack[-2000:])
        with contextlib.suppress(Exception):
            self.session.barrier(n + 1, leaving=reason, fault=None)
            self.session.leave()
        if self.sidecar is not None:
            self.sidecar.send({"bye": 1})
        os.kill(os.getpid(), signal.SIGKILL)

    def _abort_hook(self, n: int, outcome: RoundOutcome) -> None:
        if self.cfg.abort is not None:
            self.cfg.abort(self.state)

    # one round ----------------------------------------------------------------------------
    def _round(self, n: int, ready: dict[str, Any]) -> tuple[RoundOutcome, Any, str | None]:
        monitor = self.monitor
        assert monitor is not None
        state = self.state
        RestartInterrupt.last = None
        monitor.watch(n)
        if not state.active:
            return self._wait(n, None, "spare"), None, None
        env = {
            "RANK": str(state.rank),
            "WORLD_SIZE": str(state.world_size),
            "LOCAL_RANK": str(self.launch.local_rank),
            "MASTER_ADDR": ready["pg"].rpartition(":")[0],
            "MASTER_PORT": ready["pg"].rpartition(":")[2],
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        call = CallWrapper(state, monitor, ready["pg"], self.cfg.store_timeout)
        self.call = call
        kwargs = dict(self.kwargs)
        if self.param is not None:
            kwargs[self.param] = call
        value: Any = None
        fault: str | None = None
        returned = False
        try:
            with _launch.round_environment(env):
                try:
                    if self.cfg.initialize is not None:
                        self.cfg.initialize(state)
                    monitor.enter_fn(n)
                    try:
                        value = self.fn(*self.args, **kwargs)
                    finally:
                        self._leave_fn()
                    returned = True
                except RestartInterrupt:
                    self._leave_fn()
                except Exception as exc:
                    self._leave_fn()
                    fault = self._fault(n, exc)
                except BaseException as exc:
                    self._leave_fn()
                    self.session.stop(
                        n,
                        RoundOutcome.end(
                            f"raised {type(exc).__qualname__}",
                            rank=state.initial_rank,
                            error=describe(exc),
                        ),
                    )
                    events.emit("end", error=describe(exc))
                    raise
        finally:
            self.call = None
            call._close()
        self._check_swallowed(returned)
        if returned:
            self.session.complete(n, state.world_size)
            return self._wait(n, self.cfg.completion_timeout, "completion"), value, None
        return self._wait(n, self.cfg.barrier_timeout, "abort"), None, fault

    def _leave_fn(self) -> None:
        """Leave the function; a restart interrupt arriving meanwhile is absorbed."""
        assert self.monitor is not None
        for _ in range(3):
            try:
                self.monitor.leave_fn()
                return
            except RestartInterrupt:
                continue

    def _fault(self, n: int, exc: Exception) -> str | None:
        assert self.monitor is not None
        desc = describe(exc)
        if self.monitor.aborted_round == n:
            logger.debug("rank %d: %s after the round was aborted", self.launch.rank, desc)
            return None
        first = self.session.stop(
            n, RoundOutcome.fault(self.launch.rank, desc, type(exc).__qualname__)
        )
        if first:
            logger.warning("rank %d: fault in round %d: %s", self.launch.rank, n, desc)
            events.emit("fault", error=desc, type=type(exc).__qualname__)
            return desc
        logger.debug("rank %d: %s after another rank's fault", self.launch.rank, desc)
        return None

    def _check_swallowed(self, returned: bool) -> None:
        interrupt = RestartInterrupt.last
        if interrupt is None or not returned:
            return
        where = interrupt.swallowed_at()
        logger.warning(
            "rank %d: the restart interrupt raised at %s was swallowed at %s; let "
            "BaseException propagate (catch Exception instead)",
            self.launch.rank,
            interrupt.raised_at,
            where,
        )
        events.emit("interrupt_swallowed", raised_at=interrupt.raised_at, swallowed_at=where)

    def _wait(self, n: int, timeout: float | None, what: str) -> RoundOutcome:
        assert self.monitor is not None
        start = time.monotonic()
        outcome = self.monitor.wait_outcome(timeout)
        if outcome is None:
            self.session.stop(n, RoundOutcome.end(f"{what} timed out", rank=self.launch.rank))
            raise BarrierTimeoutError(
                f"round {n}: the {what} wait timed out after {timeout:g} s; raise "
                f"{'completion_timeout' if what == 'completion' else 'barrier_timeout'} or "
                "look for a stuck rank"
            )
        events.emit("outcome_wait", duration=time.monotonic() - start, what=what)
        return outcome
