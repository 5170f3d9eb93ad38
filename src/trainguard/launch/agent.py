"""The trainguard agent: torchrun's ``LocalElasticAgent`` that replaces one dead worker at a time.

torch's agent stops every local worker as soon as one exits non-zero and then restarts the whole
job. :class:`TrainguardAgent` keeps torch's state machine (rendezvous, rank assignment, the
monitor loop, the whole-job restart with ``--max-restarts``, the exit barrier, signal handling)
and changes what one worker's death does:

1. ``_monitor_workers`` polls each worker's process itself (torch's ``PContext.wait`` would
   kill the others). A non-zero exit emits ``launch_worker_died`` and, when a sidecar service
   is set, calls ``service.died(...)``, which writes the death notice the in-process layer acts
   on; only after it returned is the slot respawned.
2. The slot gets a new process (same ``RANK``, ``TRAINGUARD_INCARNATION`` one higher, log and
   error files of its own) within its respawn budget and after its back-off; the other workers
   keep their processes.
3. When a slot's budget is used up, it crash-loops, or any agent or worker set the job's
   escalation key, the agent sets that key (so every agent sees it on its next tick) and
   returns ``FAILED``: torch's own loop then stops every worker and, with restarts left,
   rendezvous again; the next round gets a new generation.

Nodes (with the node heartbeat and, for the c10d rendezvous, the admission gate; see
:mod:`trainguard.coord.node_ring`, :mod:`trainguard.launch._gate`,
:mod:`trainguard.launch._nodes`):

4. After each rendezvous the agent follows the generation in the gate, publishes its workers'
   ranks and starts its heartbeat; group rank 0 drops the vacancies of older generations.
5. The agent that declares a node lost tells the sidecar service that each of its ranks is
   gone, emits ``launch_node_lost``, marks the node lost for the exit barrier and offers its
   group rank as a vacancy. A node cut off from the store fences itself before it can be
   declared lost; a node that was declared lost rejoins through a vacancy or leaves the job,
   and never restarts or ends the rest of it (:mod:`trainguard.launch._partition`).
6. An agent that starts while the job runs first claims a vacancy: it then takes the lost
   node's group rank and ranks without a rendezvous round, its workers start as newcomers
   (``TRAINGUARD_INCARNATION`` >= 1) and its heartbeat makes the node live again.
7. The exit barrier runs in the coordination store and counts lost nodes as arrived.

8. Preemption: a SIGTERM to the agent goes to its workers at once, whatever the agent is
   doing, and no signal is lost (:mod:`trainguard.launch._signals`); the workers save, and the
   agent waits for them within the grace budget and then counts its node as finished in the
   exit barrier (:mod:`trainguard.launch._preempt`). A worker that exits with status 75 was
   preempted, its slot is done (:attr:`TrainguardAgent.preempted`). torch's own shutdown at
   the end of a run or for a whole-job restart is no preemption.
9. A worker's request to end the job (an error before its first round) ends it at once on
   every node: no respawn, no whole-job restart (:attr:`TrainguardAgent.cannot_start`).

Over 400 lines: one subclass of torch's agent; each override is torch's method with
trainguard's change, and they share the state machine's fields.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from trainguard import _env, events
from trainguard.coord.node_ring import NodeRing
from trainguard.launch import _agenthooks, _compat, _escalation, _preempt
from trainguard.launch._agenthooks import Heartbeat, Service
from trainguard.launch._coordstore import CoordStore, Generation
from trainguard.launch._gate import AdmissionGate
from trainguard.launch._logs import AgentLogsSpecs, incarnation_launch, tail
from trainguard.launch._nodes import AgentNodes
from trainguard.launch._partition import Partition, Verdict
from trainguard.launch._quarantine import NodeQuarantine
from trainguard.launch._signals import SignalWatch
from trainguard.launch._slots import Escalate, Respawn, SlotPolicy, SlotTable
from trainguard.launch._warm import WarmPool
from trainguard.launch.options import LaunchOptions
from trainguard.restart.preempt import EXIT_PREEMPTED

__all__ = ["Heartbeat", "Service", "TrainguardAgent"]

logger = logging.getLogger(__name__)


class TrainguardAgent(LocalElasticAgent):
    """torch's local agent with per-slot respawn (see the module docstring).

    Args:
        spec, logs_specs, start_method, log_line_prefix_template, shutdown_timeout,
            health_check_server: as for ``LocalElasticAgent``.
        options: the trainguard settings (``--tg-*``).

    Hooks, set before :meth:`run`: :attr:`service` (``None``: no sidecar service; else
    ``expect`` is called right after each worker process starts, ``died`` before a dead
    worker's slot is respawned and ``gone`` for each rank of a node this agent declared lost),
    :attr:`heartbeat_factory` (``None``: no node heartbeat; else called with the agent once per
    generation, after ``nodes.place`` is known, to make :attr:`heartbeat`, which is started then
    and closed when the workers stop; :meth:`node_heartbeat` makes the usual one). When the
    rendezvous handler is an :class:`AdmissionGate` (c10d), lost nodes' group ranks are offered
    to replacement nodes and this agent claims one before its first rendezvous.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        options: LaunchOptions,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        health_check_server: Any = None,
    ) -> None:
        self.logs = AgentLogsSpecs(logs_specs)
        super().__init__(
            spec,
            self.logs,
            start_method=start_method,
            exit_barrier_timeout=options.exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
            health_check_server=health_check_server,
        )
        settings = _env.settings()
        self.options = options
        self.service: Service | None = None
        self.heartbeat: Heartbeat | None = None
        self.heartbeat_factory: Callable[[TrainguardAgent], Heartbeat] | None = None
        self.run_id = spec.rdzv_handler.get_run_id()
        self._first_rendezvous = True
        self.coord = CoordStore(
            external=options.store or settings.store_addr, timeout=options.heartbeat_timeout
        )
        self.generation: int | None = None
        self.slots: SlotTable | None = None
        self.events_dir = options.events_dir or settings.events_dir
        self.events = events.EventLog(self.events_dir)
        rdzv = spec.rdzv_handler
        self.nodes = AgentNodes(
            run_id=self.run_id,
            options=options,
            coord=self.coord,
            gate=rdzv if isinstance(rdzv, AdmissionGate) else None,
            log=self.events,
            gone=lambda slot, cause: _agenthooks.gone(self.service, slot, cause),
        )
        self.partition = Partition(
            options=options,
            nodes=self.nodes,
            coord=self.coord,
            log=self.events,
            kill_workers=self._kill_workers,
        )
        self._taken: tuple[Generation, int] | None = None  # the vacancy an evicted node took
        self._tails: list[TailLog] = []
        self._error_files: dict[int, str] = {}
        self._died_at: dict[int, float] = {}
        self.last_escalation: str | None = None  # why the last whole-job restart was asked
        self.preempted = False  # a worker ended preempted (exit status 75)
        self.cannot_start: str | None = None  # the error that ended the job before it ran
        self._sigterm_sent: set[int] = set()  # workers the preemption's SIGTERM went to
        self.signals = SignalWatch(lambda: _preempt.forward(self, self._sigterm_sent))
        self.warm = WarmPool(options.warm_workers, self.events.emit)  # --tg-warm-workers
        host = settings.host_name or socket.gethostname()  # the name its workers report
        self.quarantine = NodeQuarantine(options, self.events.emit, host, spec.local_world_size)

    # rendezvous and start ------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous round, then the coordination store and the generation; or, for
        a node that starts while the job runs, a lost node's place (no rendezvous round)."""
        taken = self.nodes.take_vacancy(worker_group) if self._first_rendezvous else None
        if self._taken is not None:  # an evicted node rejoins in the place it claimed
            taken, self._taken = self._taken, None
        self._first_rendezvous = False
        if taken is None:
            super()._rendezvous(worker_group)
            joined, incarnation = self.coord.join_group(worker_group, self.run_id), 0
        else:
            joined, incarnation = taken
        self.generation = joined.generation
        self.events.set_context(rank=-1 - (worker_group.group_rank or 0))
        self.events.emit(
            "launch_generation",
            generation=joined.generation,
            node=worker_group.group_rank,
            nodes=worker_group.group_world_size,
            store=joined.addr,
            replacement=taken is not None,
        )
        self.logs.extra_env = self._worker_env(joined, incarnation)
        policy = SlotPolicy(self.options.respawns, self.options.respawn_backoff)
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        self.slots = SlotTable(ranks, policy, incarnation=incarnation)
        self.nodes.enter(worker_group, joined)
        self._start_heartbeat()
        self.signals.reraise()

    def _worker_env(self, joined: Generation, incarnation: int) -> dict[str, str]:
        """What the agent adds to torch's environment of every worker it starts."""
        env = _agenthooks.worker_env(self.service, self.options, self.events_dir)
        env.update(self.quarantine.env())  # --tg-quarantine-after: the workers' policy
        env["TRAINGUARD_GENERATION"] = str(joined.generation)
        env["TRAINGUARD_INCARNATION"] = str(incarnation)
        return {"TRAINGUARD_STORE_ADDR": joined.addr, **env}

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        self.signals.install()  # torch's start set its handler again
        context = _compat.pcontext(self)
        assert self.slots is not None
        self._error_files = {lr: _compat.launch_of(context, lr).error_file for lr in pids}
        for local_rank, pid in pids.items():
            self.slots.started(local_rank, pid)
            rank, incarnation = self.slots.rank(local_rank), self.slots.incarnation(local_rank)
            _agenthooks.expect(self.service, rank, pid, incarnation)
        self.warm.start(context)
        return pids

    # monitor -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """One tick (:meth:`_tick`); a signal that something in it swallowed is raised."""
        self.signals.reraise()
        result = self._tick(worker_group)
        self.warm.poll()
        self.quarantine.poll()  # learns whether its host was taken out, or let back
        self.signals.reraise()
        return result

    def _tick(self, worker_group: WorkerGroup) -> RunResult:
        """D-state check, escalation key (one store ``check``), each worker's exit, due
        respawns."""
        stuck = _compat.check_uninterruptible(self, worker_group)
        if stuck is not None:
            return stuck
        verdict = self.partition.tick()
        if verdict is Verdict.EVICTED:
            return self._evicted(worker_group)
        if verdict is Verdict.LEAVE:
            return self._leave(self.partition.left or "this node left the job")
        if verdict is Verdict.FENCED:
            return RunResult(state=WorkerState.HEALTHY)
        reason = _escalation.requested(self)
        if reason is not None:  # already in the store (or the store is gone): nothing to set
            return _escalation.escalate(self, reason, {}, announce=False)
        context = _compat.pcontext(self)
        assert self.slots is not None
        for local_rank in self.slots.running():
            if self.partition.fenced:  # the fence came down during this tick
                return RunResult(state=WorkerState.HEALTHY)
            code = _compat.exit_code(_compat.handler(context, local_rank))  # not reaped yet
            if code is not None:
                result = self._on_exit(worker_group, local_rank, code)
                if result is not None:
                    return result
        for local_rank in self.slots.due():
            if self.partition.fenced:
                break
            self._respawn(worker_group, local_rank)
        if self.slots.all_done:
            done = {w.global_rank: None for w in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=done)
        return RunResult(state=WorkerState.HEALTHY)

    def _kill_workers(self) -> list[int]:
        """SIGKILL every running worker's process group (the fence; any thread)."""
        slots = self.slots
        if slots is None:
            return []
        return _compat.kill_groups(getattr(self, "_pcontext", None), slots.running())

    def _evicted(self, group: WorkerGroup) -> RunResult:
        """This node was declared lost: stop its workers, then take a free place of the job
        again (``--tg-on-evicted rejoin``) or leave it. Never a whole-job restart."""
        reason = self.nodes.eviction or "declared lost"
        self.events.emit("launch_evicted", reason=reason, then=self.options.on_evicted)
        if self.options.on_evicted != "rejoin":
            return self._leave(f"{reason}; it leaves the job (--tg-on-evicted exit)")
        self._stop_workers(group)
        taken = None
        try:
            taken = self.nodes.take_vacancy(group, fresh=True)
        except Exception as exc:
            logger.warning("cannot take a free place of the job (%s)", exc)
        if taken is None:
            return self._leave(f"{reason}; no free place of the job was left to rejoin")
        self._taken = taken
        self._initialize_workers(group)
        self.events.emit("launch_rejoined", node=group.group_rank, generation=taken[0].generation)
        return RunResult(state=WorkerState.HEALTHY)

    def _leave(self, reason: str) -> RunResult:
        """This node leaves the job; the job goes on without it (exit status 3)."""
        self.partition.left = reason
        self.events.emit("launch_left", reason=reason)
        logger.error("%s", reason)
        _compat.no_more_restarts(self)
        return RunResult(state=WorkerState.FAILED)

    def _on_exit(self, group: WorkerGroup, local_rank: int, code: int) -> RunResult | None:
        assert self.slots is not None
        pid = _compat.handler(_compat.pcontext(self), local_rank).proc.pid
        rank, incarnation = self.slots.rank(local_rank), self.slots.incarnation(local_rank)
        decision = self.slots.exited(local_rank, code)
        if decision is not None and self.quarantine.out:  # its host is out: no respawn
            decision = None  # done for this generation
            self.slots.hold(local_rank)
            self.events.emit("launch_worker_held", slot=rank, worker_pid=pid, exit_code=code)
        if code == EXIT_PREEMPTED:
            self.preempted = True
            logger.warning("[%s] rank %d was preempted (its state saved)", group.spec.role, rank)
        # what the dead worker left in its group dies before its respawn; signalled before the
        # reap, while the group's id cannot be another process's
        _compat.reap(
            _compat.handler(_compat.pcontext(self), local_rank),
            kill_group=isinstance(decision, Respawn),
        )
        if decision is None:
            # a normal end; a wrapped call left without goodbye still needs its notice
            self._service_died(rank, pid, code, returning=False)
            return None
        self._died_at[local_rank] = time.monotonic()
        self.events.emit(
            "launch_worker_died",
            slot=rank,
            worker_pid=pid,
            exit_code=code,
            incarnation=incarnation,
        )
        what = (group.spec.role, rank, pid, incarnation, code)
        logger.warning("[%s] rank %d (pid %d, incarnation %d) exited with %d", *what)
        self._service_died(rank, pid, code, returning=isinstance(decision, Respawn))
        failure = ProcessFailure(local_rank, pid, code, self._error_files[local_rank])
        asked = _escalation.requested(self)  # the worker may have asked before it exited
        if asked is not None:
            return _escalation.escalate(self, asked, {rank: failure}, announce=False)
        if isinstance(decision, Escalate):
            return _escalation.escalate(self, decision.reason, {rank: failure})
        return None

    def _respawn(self, group: WorkerGroup, local_rank: int) -> None:
        """Start the slot's next incarnation in place of its dead process."""
        assert self.slots is not None
        context = _compat.pcontext(self)
        _compat.release(_compat.handler(context, local_rank))
        first = _compat.launch_of(context, local_rank)
        incarnation = self.slots.incarnation(local_rank) + 1
        launch, files = incarnation_launch(first, incarnation)
        new, warm = self.warm.replace(context, local_rank, launch)
        self.slots.started(local_rank, new.proc.pid)
        self._error_files[local_rank] = files.error_file
        group.workers[local_rank].id = new.proc.pid
        rank = self.slots.rank(local_rank)
        _agenthooks.expect(self.service, rank, new.proc.pid, incarnation)
        self._tails += tail(group.spec.role, self.logs.dest, local_rank, files)
        waited = time.monotonic() - self._died_at.pop(local_rank, time.monotonic())
        self.events.emit(
            "launch_respawned",
            slot=rank,
            worker_pid=new.proc.pid,
            incarnation=incarnation,
            seconds=waited,
            warm=warm,
        )
        logger.info("rank %d respawned as pid %d (incarnation %d)", rank, new.proc.pid, incarnation)

    # the sidecar service and the node heartbeat -------------------------------------------
    def _service_died(self, slot: int, pid: int, code: int, *, returning: bool) -> None:
        timeout = self.options.heartbeat_timeout
        _agenthooks.died(self.service, slot, pid, code, returning=returning, timeout=timeout)

    def _start_heartbeat(self) -> None:
        self._close_heartbeat()
        if self.heartbeat_factory is not None:
            self.heartbeat = self.heartbeat_factory(self)
            self.heartbeat.start()
            self.partition.start(self.heartbeat)

    def node_heartbeat(self) -> NodeRing:
        """This node's heartbeat in the current generation (the usual ``heartbeat_factory``):
        ``--tg-heartbeat-interval``/``--tg-heartbeat-timeout``; a node it declares lost is
        counted out (:class:`~trainguard.launch._nodes.AgentNodes`)."""
        return self.nodes.heartbeat()

    def _close_heartbeat(self) -> None:
        self.partition.close()
        if self.heartbeat is not None:
            heartbeat, self.heartbeat = self.heartbeat, None
            heartbeat.close()

    # stop, exit, shutdown ------------------------------------------------------------------
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_heartbeat()  # no node of this generation is judged any more
        super()._stop_workers(worker_group)

    def _exit_barrier(self) -> None:
        """Wait for the other agents in the coordination store; nodes that were lost count as
        arrived (see :mod:`trainguard.launch._nodes`)."""
        if self.nodes.place is None or self.coord.client is None:
            super()._exit_barrier()  # type: ignore[no-untyped-call]
            return
        with _compat.in_exit_barrier(self):
            self.nodes.exit_barrier()  # a signal ends it: the workers are done, no reraise

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self.signals.preempted() and self._pcontext is not None:
            grace = self.options.preemption_grace
            deadline = time.monotonic() + grace + _preempt.PREEMPT_MARGIN
            saved = _preempt.save(self, grace, self._sigterm_sent)
            if saved:
                _preempt.arrive(self, deadline)
            self.preempted = saved or self.preempted
            timeout = 0  # those still running are killed at once
        self._close_heartbeat()
        self.warm.close()
        super()._shutdown(death_sig, timeout)
        tails, self._tails = self._tails, []
        for t in tails:
            t.stop()

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run loop, with the sidecar service for the workers started before it; the
        service, the coordination store and the event log close after it."""
        if self.service is None:
            from trainguard.restart.sidecar import SidecarService

            self.service = SidecarService(
                name="agent", log_dir=self.events_dir, rejoin_timeout=self.options.rejoin_timeout
            )
        self.service.start()
        try:
            result: RunResult = super().run(role)
            return result
        finally:
            self.signals.close()
            self.warm.close()
            self.quarantine.close()
            self.service.close()
            self.coord.close()
            self.events.close()
