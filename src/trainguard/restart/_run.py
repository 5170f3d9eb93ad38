"""One call of a wrapped function on one rank: its rounds, and what one fault sets off.

The methods of :class:`WrappedCall` read in the order things happen. One fault, top to bottom:

1. :meth:`WrappedCall._round`: the function raises on some rank. That rank proposes the
   round's outcome, a fault (:meth:`_fault`: ``Session.stop``, first proposal wins). A hang
   seen by the watchdog (:func:`._diagnose.record_hang`) or a death seen by a sidecar proposes one the same way.
2. Every rank's monitor thread wakes on the outcome (:mod:`.monitor`): it interrupts the
   function (``RestartInterrupt``), aborts torch.distributed and calls :meth:`_aborted` (the
   user's ``abort`` hook). A main thread that stays blocked is reported to :meth:`_stuck`:
   that rank leaves the job and its process ends.
3. The main thread, out of the function, collects the outcome (:meth:`_wait`).
4. :meth:`_rounds` then tears the round's groups down, runs ``finalize`` and
   ``health_check`` (a rank whose hook raised leaves at the next barrier) and goes to the
   next round's barrier with the fault in its record.

Over 400 lines: one class whose methods read in the order things happen (above); split, one
fault's path would go back and forth between two files.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainguard import _aborts, _progress, events
from trainguard._errtext import brief
from trainguard.errors import BarrierTimeoutError, JobEndedError, RetryLimitError
from trainguard.restart import _beside, _diagnose, _environment
from trainguard.restart._helper import HelperHandle
from trainguard.restart._hostcheck import (
    HostCheck,
    consequence,
    end_error,
    own_error,
    raised_cause,
)
from trainguard.restart._interrupt import Kick
from trainguard.restart._preconnect import Preconnect
from trainguard.restart._records import RoundLayout
from trainguard.restart._session import Session
from trainguard.restart.abort import GroupSockets, destroy_groups, shutdown_connections_to
from trainguard.restart.call import CallWrapper
from trainguard.restart.config import WrapperConfig
from trainguard.restart.monitor import Monitor, MonitorHooks
from trainguard.restart.preempt import Preemption
from trainguard.restart.state import RestartInterrupt, RoundOutcome, RoundState, describe
from trainguard.restart.watchdog import Watchdog
from trainguard.stragglers.round import StragglerWatch

logger = logging.getLogger(__name__)

_call_counter = itertools.count()  # wrapped calls made by this process (keyspace of each)


class WrappedCall:
    """One call of a wrapped function on this rank (built and run by the Wrapper)."""

    def __init__(
        self,
        cfg: WrapperConfig,
        fn: Callable[..., Any],
        param: str | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> None:
        self.cfg, self.fn, self.param, self.args, self.kwargs = cfg, fn, param, args, kwargs
        self.launch = _environment.detect()
        self.session = Session(self.launch, next(_call_counter), cfg)
        self.monitor: Monitor | None = None
        self.sidecar: HelperHandle | None = None
        self.watchdog: Watchdog | None = None
        self.preconnect: Preconnect | None = None
        self.call: CallWrapper | None = None
        self.stragglers: StragglerWatch | None = None  # made once the session is open
        self.left_early = False
        self.entered = False  # this process entered a round (a newcomer may never)
        self.round_store: str | None = None  # the round store's "host:port" (ready.pg)
        self.raised: Exception | None = None  # what the function raised in this round
        self.hosts = HostCheck(cfg.quarantine, self.session.host)  # attribution, quarantine
        self.state = RoundState(
            round=0, initial_rank=self.launch.rank, initial_world_size=self.launch.world_size
        )
        grace = cfg.preemption_grace
        assert isinstance(grace, float)  # checked by WrapperConfig
        self.preemption = Preemption(grace, self.launch.rank)

    # the call -----------------------------------------------------------------------------
    def run(self) -> Any:
        """Every round until one completes (its value) or the job ends (an exception)."""
        start = time.monotonic()
        log = events.get_log()
        saved_context = (log.rank, log.round)
        events.set_context(rank=self.launch.rank, round=0)
        GroupSockets.install(connect_bound=self.cfg.abort_timeout)  # see restart._setup
        Preconnect.install()
        finished = False
        kick = Kick.install()
        self.preemption.install()
        try:
            self._start(log.directory, kick)
            value = self._rounds()
            finished = True
            events.emit("complete", duration=time.monotonic() - start, rounds=self.state.round + 1)
            return value
        except BaseException as exc:
            # Make sure the others learn that this rank is gone from the round it was in.
            outside = self.session.joining and not self.entered
            if self.monitor is not None and self.monitor.outcome is None and not outside:
                with contextlib.suppress(Exception):
                    self.session.stop(
                        self.state.round,
                        RoundOutcome.end("left with an error", rank=self.launch.rank),
                    )
            if isinstance(exc, (RetryLimitError, JobEndedError)) and not self.preemption.signalled:
                _environment.escalate(exc)
            raise
        finally:
            self._stop(kick, finished)
            log.rank, log.round = saved_context

    def _start(self, log_dir: Any, kick: Kick | None) -> None:
        """Connect, start the sidecar, the monitor thread and the watchdog thread."""
        cfg, session, rank = self.cfg, self.session, self.launch.rank
        session.open()
        self.preemption.bind(session.coord, session.keys, session.clone_coord)
        self.stragglers = _beside.make_stragglers(cfg, session, rank)
        self.sidecar = _beside.make_sidecar(cfg, session, rank, log_dir)
        hooks = MonitorHooks(
            aborted=self._aborted,
            stuck=self._stuck,
            kick=kick.send if kick is not None else None,
        )
        self.monitor = _beside.make_monitor(cfg, session, self.sidecar, hooks)
        self.preconnect = Preconnect(session.coord, session.keys, timeout=cfg.store_timeout)
        self.watchdog = _beside.make_watchdog(
            cfg, session, rank, self._progress_state, self.sidecar
        )

    def _stop(self, kick: Kick | None, finished: bool) -> None:
        """Stop the threads and the sidecar, leave the job, drop the store connections."""
        RestartInterrupt.last = None  # one raised late holds the function's frames too
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        if self.monitor is not None:
            self.monitor.close()
        destroy_groups()
        GroupSockets.uninstall()
        Preconnect.uninstall()
        self.session.leave()
        # before the wait below: no watchdog lines now, its hard timeout would kill this rank
        if self.sidecar is not None:
            self.sidecar.stop()
            self.sidecar = None
        if self.preconnect is not None:  # a connect under way must not hold the others back
            self.preconnect.close(timeout=self.cfg.store_timeout)
            self.preconnect = None
        if kick is not None:
            kick.restore()
        self.preemption.uninstall()
        timeout = self.cfg.barrier_timeout if finished else min(10.0, self.cfg.barrier_timeout)
        self.session.close(early=self.left_early, timeout=timeout)
        self.monitor = None

    def _rounds(self) -> Any:
        leaving = self._hook("health_check", self.state)
        fault: str | None = None
        n = 0
        joined = self._join(leaving) if self.session.joining else None
        if self.session.joining and joined is None:
            return None  # the job completed before this newcomer was admitted
        mark = _progress.count()
        while True:
            progress, mark = _progress.count() != mark, _progress.count()
            ready: RoundLayout | None
            if joined is not None:
                (n, ready), joined = joined, None
            else:
                ready = self.session.barrier(
                    n,
                    leaving=describe(leaving) if leaving else None,
                    fault=fault,
                    progress=progress,
                    **self.hosts.record(self.state),
                )
            if ready is None:
                assert leaving is not None
                self.left_early = True
                raise leaving
            self._enter(n, ready)
            outcome, value, fault = self._round(n, ready)
            raised, self.raised = self.raised, None
            _diagnose.check_raised(self.launch.rank, n, raised, outcome)
            self.hosts.raised = raised_cause(raised)  # first or not, for the attribution
            del raised  # its traceback holds the round's frames (and its process group)
            if self.preconnect is not None:
                self.preconnect.forget(n)
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
            # a fault (or a newcomer's admission): this rank restarts
            destroy_groups()
            GroupSockets.take()
            faulted = outcome.rank if outcome.rank is not None else -1
            self.state = self.state.replace(
                faults={faulted: outcome.error or ""} if outcome.why == "fault" else {}
            )
            leaving = (
                self._hook("finalize", self.state)
                or self._hook("health_check", self.state)
                or self._take_out()
                or self._sidecar_lost()
            )
            n += 1

    def _join(self, leaving: BaseException | None) -> tuple[int, RoundLayout] | None:
        """A newcomer's first round (:meth:`Session.join`), None when the job completed
        before it was admitted; raises ``leaving`` (its health check failed)."""
        if leaving is not None:
            self.left_early = True
            raise leaving
        sidecar = self.sidecar

        def notify(n: int, roster: Sequence[int]) -> None:
            if sidecar is not None:
                sidecar.send({"round": n, "roster": list(roster)})

        return self.session.join(notify)

    def _enter(self, n: int, ready: RoundLayout) -> None:
        """Take round ``n`` as published; raise if the job stops there."""
        self.entered = True
        self.state = RoundState.of_layout(ready, self.launch.rank, self.launch.world_size)
        if self.sidecar is not None:
            self.sidecar.send({"round": n, "roster": list(self.session.roster)})
        events.set_context(round=n)
        self.hosts.enter(ready, self.state)
        if ready.end:
            causes = {**self.state.gone, **self.state.faults}
            lost = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.state.gone.items()))
            raise end_error(ready.end)(
                ready.end + (f"; ranks lost: {lost}" if lost else ""), causes=causes
            )
        events.emit(
            "round_start",
            active=list(self.state.active_ranks),
            spares=list(self.state.spare_ranks),
            rank_in_round=self.state.rank,
            world_size=self.state.world_size,
        )

    # one round ----------------------------------------------------------------------------
    def _round(self, n: int, ready: RoundLayout) -> tuple[RoundOutcome, Any, str | None]:
        """Round ``n`` on this rank: (its outcome, the function's value, this rank's fault)."""
        monitor = self.monitor
        assert monitor is not None
        state = self.state
        RestartInterrupt.last = None
        self.round_store = ready.pg if state.active else None
        monitor.watch(n)
        if self.preconnect is not None:
            self.preconnect.ahead(n + 1)
        if not state.active:
            return self._wait(n, None, "spare"), None, None
        timer = self.stragglers.start(state, ready.pg) if self.stragglers else None
        call = CallWrapper(state, monitor, ready.pg, self.cfg.store_timeout, timer, self.preemption)
        self.call = call
        kwargs = dict(self.kwargs)
        if self.param is not None:
            kwargs[self.param] = call
        value: Any = None
        fault: str | None = None
        returned = False
        self.raised = None
        try:
            variables = _environment.round_variables(
                self.state.rank, self.state.world_size, self.launch.local_rank, ready.pg
            )
            with _environment.round_environment(variables):
                try:
                    if self.cfg.initialize is not None:
                        self.cfg.initialize(state)
                    monitor.enter_fn(n)
                    self.preemption.enter()  # SIGTERM ends it until it asks preempted()
                    try:
                        value = self.fn(*self.args, **kwargs)
                    finally:
                        self._leave_fn()
                    returned = True
                    self.preemption.returned()
                except RestartInterrupt as interrupt:
                    self._leave_fn()
                    self.raised = own_error(interrupt)  # raising when the abort came
                except Exception as exc:
                    self._leave_fn()
                    self.raised = exc
                    fault = self._fault(n, exc)
                except BaseException as exc:
                    self._leave_fn()
                    self._end(n, exc)
                    raise
        finally:
            self.call = None
            call._close()
            if self.stragglers is not None:
                self.stragglers.stop()
        _diagnose.check_swallowed(self.launch.rank, returned)
        if returned:
            self.session.complete(n, state.world_size)
            return self._wait(n, self.cfg.completion_timeout, "completion"), value, None
        return self._wait(n, self.cfg.barrier_timeout, "abort"), None, fault

    def _fault(self, n: int, exc: Exception) -> str | None:
        """The function raised: propose a fault; its description when this rank's was first."""
        assert self.monitor is not None
        desc = describe(exc)
        if self.monitor.aborted_round == n:
            logger.debug("rank %d: %s after the round was aborted", self.launch.rank, desc)
            if consequence(exc):
                self.raised = None  # the abort's consequence, not a cause to attribute
            return None
        kind = type(exc).__qualname__
        ended = self.preemption.failed(desc)  # after the stop was agreed: no restart
        if ended is not None:
            self.session.stop(n, ended)
            return None
        if self.session.stop(n, RoundOutcome.fault(self.launch.rank, desc, kind)):
            logger.warning("rank %d: fault in round %d: %s", self.launch.rank, n, brief(desc))
            logger.debug("rank %d: the fault in full: %s", self.launch.rank, desc)
            events.emit("fault", error=desc, type=kind)
            return desc
        logger.debug("rank %d: %s after another rank's fault", self.launch.rank, desc)
        return None

    def _end(self, n: int, exc: BaseException) -> None:
        """The function raised a BaseException that is not ours: the job ends."""
        reason = f"raised {type(exc).__qualname__}"
        outcome = RoundOutcome.end(reason, rank=self.state.initial_rank, error=describe(exc))
        self.session.stop(n, outcome)
        events.emit("end", error=describe(exc))

    def _aborted(self, n: int, outcome: RoundOutcome) -> None:
        """Monitor thread, after torch.distributed was aborted: this process's connections to
        the round's store are shut down (a wait on it returns at once: the round is over),
        then the user's ``abort`` hook runs."""
        _aborts.note()  # first: threads bound to the round stop using its connections
        if self.round_store:
            host, _, port = self.round_store.rpartition(":")
            shutdown_connections_to(host, int(port))
        if self.cfg.abort is not None:
            self.cfg.abort(self.state)

    def _stuck(self, n: int) -> None:
        """Monitor thread: the main thread did not leave the function after the abort.

        This rank leaves the job at round ``n+1``'s barrier (so the others go on without it)
        and its process ends: a thread blocked in the collective library cannot be recovered.
        """
        monitor = self.monitor
        reason = (
            f"still blocked in the function {self.cfg.abort_timeout:g} s after the abort of "
            f"round {n}; the process ends"
        )
        _diagnose.report_stuck(
            self.launch.rank, reason, monitor.main_thread_id if monitor else None
        )
        with contextlib.suppress(Exception):
            self.session.barrier(n + 1, leaving=reason, fault=None)
            self.session.leave()
        if self.sidecar is not None:
            self.sidecar.send({"bye": 1})
        os.kill(os.getpid(), signal.SIGKILL)

    def _wait(self, n: int, timeout: float | None, what: str) -> RoundOutcome:
        """Main thread: the round's outcome, once the monitor acted on it."""
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

    # the watchdog's side ------------------------------------------------------------------
    def _progress_state(self) -> tuple[int, bool, CallWrapper | None]:
        return self.state.round, bool(self.monitor and self.monitor.in_function), self.call

    def _take_out(self) -> BaseException | None:
        take_out = self.cfg.stragglers.take_out if self.cfg.stragglers else None
        return self._hook("health_check", self.state, take_out) if take_out else None

    def _sidecar_lost(self) -> BaseException | None:
        lost = self.watchdog.loss() if self.watchdog is not None else None
        return _diagnose.sidecar_lost(self.launch.rank, lost) if lost is not None else None

    # helpers ------------------------------------------------------------------------------
    def _hook(self, name: str, state: RoundState, hook: Any = None) -> BaseException | None:
        return _diagnose.run_hook(name, hook or getattr(self.cfg, name), state)

    def _leave_fn(self) -> None:
        """Leave the function; a restart interrupt arriving meanwhile is absorbed."""
        assert self.monitor is not None
        for _ in range(3):
            try:
                self.monitor.leave_fn()
                return
            except RestartInterrupt:
                continue
