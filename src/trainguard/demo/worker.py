"""One process of the demo: a fault-free reference run, then the guarded run.

Started by :mod:`trainguard.demo.runner` (spawn context), one per rank and spare. Process ``i``
of ``ranks + spares``:

1. If ``i < ranks``: trains ``steps`` steps with plain ``torch.distributed`` (gloo, its own
   port), no checkpoints, no faults, and reports the parameters' digest: the reference.
2. Every process builds its checkpointers once, before the wrapper: a
   :class:`LocalCheckpointManager` (replicated to a peer; a spare's also prefetches the other
   nodes' newest parts while it waits) and an :class:`AsyncCheckpointer`. It then calls the
   training function under :class:`trainguard.restart.Wrapper` (``FillGaps``,
   ``MaxActiveWorldSize(ranks)``, so process ``ranks..`` wait as spares). Each round the
   function initializes gloo (the checkpointers re-bind to the round by themselves), resumes
   from the newest checkpoint of either kind (the local one from memory when this process
   staged it), trains and injects the scheduled faults. Both are closed when the wrapper
   returns.

Every message to the parent is a tuple sent on this process's own channel (a pipe, or a file
under ``trainguard launch``: see :mod:`trainguard.demo._channel`; a killed process can never
break another's channel): ``("hello", ...)`` first, ``("step", ...)`` from rank 0 every few
steps, ``("fault", ...)`` at an injection, ``("resumed", ...)`` after each round's restore,
``("done", ...)``.

Over 400 lines: one class, the demo's guarded training loop with each fault it injects and
each way back (live state, local and durable checkpoints, preemption) beside it, so that the
demo reads as one story.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard._teardown import close_round
from trainguard.demo import faults as _faults
from trainguard.demo._channel import Channel, PipeChannel
from trainguard.demo._config import DemoConfig as DemoConfig
from trainguard.errors import StragglerError
from trainguard.restart.preempt import Preempted

if TYPE_CHECKING:
    from trainguard.checkpoint import AsyncCheckpointer, LocalCheckpointManager
    from trainguard.live import LiveState
    from trainguard.restart import CallWrapper


def reference(cfg: DemoConfig, process: int, port: int) -> str:
    """The fault-free run on ``cfg.ranks`` processes; returns the parameters' digest."""
    from trainguard.demo import model as m

    return m.reference_run(process=process, ranks=cfg.ranks, steps=cfg.steps, port=port)


def committed(path: Path) -> bool:
    """Whether ``path`` is a committed disk checkpoint (saving there again would be refused)."""
    return (path / "COMMITTED").exists()


def guarded_wrapper(
    *,
    ranks: int,
    max_rounds: int,
    soft_timeout: float,
    hard_timeout: float,
    heartbeat_timeout: float,
    finalize: Any,
    take_out_stragglers: bool = False,
) -> Any:
    """The demo's Wrapper: ``ranks`` active ranks, spares fill gaps, the job never shrinks;
    stragglers are reported (and taken out with ``take_out_stragglers``)."""
    from trainguard import restart as tr
    from trainguard.stragglers import Stragglers, TakeOutStragglers

    take_out = TakeOutStragglers(windows=3) if take_out_stragglers else None

    return tr.Wrapper(
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(ranks),
        retry=tr.RetryController(max_rounds=max_rounds, min_active_world_size=ranks),
        barrier_timeout=120,
        soft_timeout=soft_timeout,
        hard_timeout=hard_timeout,
        termination_grace_time=2,
        heartbeat_interval=0.5,
        heartbeat_timeout=heartbeat_timeout,
        finalize=finalize,
        stragglers=Stragglers(every=10, take_out=take_out),
    )


@dataclasses.dataclass(frozen=True)
class _Model:
    """One round's task, teacher, model and optimizer."""

    task: Any
    teacher: Any
    net: Any
    opt: Any


class _Guarded:
    """The training function run under the wrapper, with this process's state across rounds."""

    def __init__(self, cfg: DemoConfig, process: int, channel: Channel) -> None:
        self.cfg = cfg
        self.process = process
        self.channel = channel
        self.lose_root = False  # set by a `lostdir` fault, carried out before the next round
        self.slow = False  # set by a `slow` fault
        self.perturbed = False
        self.model: _Model | None = None  # built in the first round, kept across rounds
        self.live: LiveState = None  # type: ignore[assignment]  # with the model
        # built once, used in every round (they re-bind to each round by themselves)
        self.local, self.disk = self._open_checkpointers(cfg.local_root(process))

    def send(self, *msg: Any) -> None:
        self.channel.send(*msg)

    def __call__(self, call: CallWrapper) -> str:
        import torch.distributed as dist

        from trainguard.demo import model as m

        root = self.cfg.local_root(self.process)
        if self.lose_root:
            shutil.rmtree(root, ignore_errors=True)
            self.lose_root = False
        started = time.time()
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        local, disk = self.local, self.disk
        model = self._model()
        # the survivors' live state first (every rank, before any other collective); a
        # checkpoint only when no untorn replica holds it
        got = self.live.recover() if self.cfg.live else None
        if got is not None and got.step is not None:
            first, source = got.step, "live state"
            if got.receivers:
                source += f" (rank(s) {list(got.receivers)} received it from a replica)"
            origin = None
        else:
            self._reset(model)
            first, source = self._resume(local, model.net, model.opt)
            if got is not None:
                self.live.restored(first)
            origin = (local.last_load or {}).get("source") if source.startswith("local") else None
        self._maybe_perturb(call, model.net)
        self.send(
            "resumed",
            call.round,
            call.rank,
            self.process,
            first,
            source,
            origin,
            call.world_size,
            time.time(),
            time.time() - started,
        )
        if self._train(call, local, disk, model, first):
            self.release()  # preempted: the wrapped call raises Preempted
            return ""
        local.wait()
        disk.wait()
        digest = m.parameters_digest(model.net)
        self.release()
        self.send("done", call.rank, self.process, digest, call.round, time.time())
        return digest

    def _model(self) -> _Model:
        """This process's model and optimizer, built in its first round and kept across rounds
        (their state survives a fault in memory: :class:`trainguard.live.LiveState`)."""
        if self.model is None:
            from trainguard.demo import model as m
            from trainguard.live import LiveState

            task = m.TaskConfig()
            teacher, net = m.make_teacher(task), m.make_model(task)
            self.model = _Model(task, teacher, net, m.make_optimizer(net, task))
            self.live = LiveState(model=net, optimizer=self.model.opt, rng=True)
        return self.model

    def _reset(self, model: _Model) -> None:
        """Put ``model`` back to the state a fresh start has (before a checkpoint is loaded
        into it, or when there is none)."""
        from trainguard.demo import model as m

        fresh = m.make_model(model.task)
        model.net.load_state_dict(fresh.state_dict())
        model.opt.load_state_dict(m.make_optimizer(fresh, model.task).state_dict())

    def _open_checkpointers(self, root: Path) -> tuple[LocalCheckpointManager, AsyncCheckpointer]:
        """This process's local and disk checkpointers (closed by :meth:`close`). A spare's
        manager copies the newest complete iteration of the other nodes' roots into its own
        while it waits (a hot spare: taking over a rank then needs no transfer)."""
        from trainguard.checkpoint import (
            AsyncCheckpointer,
            CliqueReplication,
            LocalCheckpointManager,
        )

        spare = self.process >= self.cfg.ranks
        roots = [self.cfg.local_root(p) for p in range(self.cfg.world)] if spare else None
        local = LocalCheckpointManager(
            root,
            replication=CliqueReplication(factor=2, jump=1),
            keep=2,
            timeout=30,
            spare_roots=roots,
            spare_interval=0.25,
        )
        try:
            disk = AsyncCheckpointer(commit_timeout=30)
        except BaseException:
            local.close()
            raise
        return local, disk

    def _resume(self, local: LocalCheckpointManager, net: Any, opt: Any) -> tuple[int, str]:
        """Restore from the newest checkpoint, local or on disk; returns (first step, source)."""
        import torch

        from trainguard.checkpoint import latest, load

        first, source = 0, "fresh start"
        it = local.find_latest()
        on_disk = latest(Path(self.cfg.out) / "ckpt")
        disk_step = int(on_disk.name.split("_")[-1]) if on_disk is not None else -1
        state: Any = None
        if it is not None and it >= disk_step:
            state = local.load(it)
            source = f"local checkpoint {it}"
        elif on_disk is not None:
            state = load(on_disk)
            source = f"disk checkpoint {on_disk.name}"
        if state is not None:
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            first = int(state["step"])
        return first, source

    def _maybe_perturb(self, call: CallWrapper, net: Any) -> None:
        """The ``perturb`` test hook: flip one bit of one parameter on rank 0 after the first
        restore (live or from a checkpoint)."""
        import torch

        if self.cfg.perturb and not self.perturbed and call.rank == 0 and call.round > 0:
            with torch.no_grad():
                w = next(net.parameters()).view(-1)
                w[:1].view(torch.int32).bitwise_xor_(1)  # one bit of one parameter
            self.perturbed = True

    def _train(
        self,
        call: CallWrapper,
        local: LocalCheckpointManager,
        disk: AsyncCheckpointer,
        model: _Model,
        first: int,
    ) -> bool:
        """Steps ``first..`` with the scheduled faults, reports to the parent and checkpoints;
        True when the job was preempted (the step it stopped at is saved)."""
        from trainguard import events
        from trainguard.demo import model as m

        cfg, net, opt = self.cfg, model.net, model.opt
        recent: list[float] = []
        for step in range(first, cfg.steps):
            if call.preempted(step):
                self._save_preempted(call, local, disk, model, step, first)
                return True
            self._maybe_inject(call, step)
            t0 = time.monotonic()
            with call.section("data"):
                x, y = m.batch(model.task, model.teacher, step, call.rank)
                if self.slow:  # a `slow` fault: this process straggles from then on
                    time.sleep(_faults.SLOW_S)
            lr = m.learning_rate(model.task, step, cfg.steps)
            loss = m.train_step(net, opt, x, y, call.world_size, lr, self.live.update(step, call))
            if cfg.step_time > 0:  # a longer step, as if the model were larger
                time.sleep(max(0.0, cfg.step_time - (time.monotonic() - t0)))
            events.emit("train_step", step=step, loss=loss, duration=time.monotonic() - t0)
            call.ping()
            recent.append(loss)
            if call.rank == 0 and (step % cfg.report_every == 0 or step == cfg.steps - 1):
                mean = sum(recent) / len(recent)  # the loss averaged since the last report
                self.send("step", step, mean, call.round, call.world_size, time.time())
                recent.clear()
            done = step + 1
            if done % cfg.local_every == 0 and done < cfg.steps:
                with events.span("ckpt_stall", what="local", step=step):
                    local.save(m.training_state(net, opt, done), done)
            path = Path(cfg.out) / "ckpt" / f"step_{done:06d}"
            # a round that resumed before a committed disk checkpoint does not save it again
            # (it is the same state; an overwrite would only cost a write)
            if done % cfg.disk_every == 0 and done < cfg.steps and not committed(path):
                with events.span("ckpt_stall", what="disk", step=step):
                    disk.save(m.training_state(net, opt, done), path)
        return False

    def _save_preempted(
        self,
        call: CallWrapper,
        local: LocalCheckpointManager,
        disk: AsyncCheckpointer,
        model: _Model,
        step: int,
        first: int,
    ) -> None:
        """The job stops before ``step``: save it (local and disk, unless saved already) and
        wait for both within the grace budget."""
        from trainguard.demo import model as m

        cfg, net, opt = self.cfg, model.net, model.opt
        if step % cfg.local_every and step != first:
            local.save(m.training_state(net, opt, step), step)
        path = Path(cfg.out) / "ckpt" / f"step_{step:06d}"
        if step % cfg.disk_every and not committed(path):
            disk.save(m.training_state(net, opt, step), path)
        local.wait(timeout=call.grace_left())
        disk.wait(timeout=call.grace_left())
        self.send("preempted", call.rank, self.process, step, time.time())

    def release(self, state: Any = None) -> None:
        """End this round's process group (the wrapper's finalize hook, and the end of the
        function). The checkpointers stay: the next round uses them again."""
        close_round([], strict=False)

    def close(self, *, strict: bool) -> None:
        """Close both checkpointers (once the wrapper returned); ``strict``: raise their
        errors (the job succeeded), else log them."""
        close_round([self.local, self.disk], strict=strict)

    def _maybe_inject(self, call: Any, step: int) -> None:
        asked = _faults.requested(self.cfg.out)
        if step in asked.held:  # every rank waits here, pinging
            deadline = time.monotonic() + 120
            while step in asked.held and time.monotonic() < deadline:
                time.sleep(0.05)
                call.ping()
                asked = _faults.requested(self.cfg.out)
        for fault in (*self.cfg.faults, *asked.faults):
            if fault.step != step or fault.rank != call.rank:
                continue
            if not _faults.claim(self.cfg.out, fault):
                continue
            from trainguard import events

            events.emit("demo_fault", fault=fault.kind, step=step, target=call.rank)
            self.send("fault", fault.kind, step, call.rank, self.process, call.round, time.time())
            if fault.kind == "lostdir":
                self.lose_root = True
            self.slow = self.slow or fault.kind == "slow"
            _faults.inject(fault)


def main(cfg: DemoConfig, process: int, job_port: int, ref_port: int, conn: Any) -> None:
    """Entry point of demo process ``process`` started by the demo itself (spawn target)."""
    os.environ.update(
        RANK=str(process),
        WORLD_SIZE=str(cfg.world),
        LOCAL_RANK=str(process),
        LOCAL_WORLD_SIZE=str(cfg.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job_port),
    )
    in_reference = process < cfg.ranks and not cfg.resumed
    run_process(cfg, process, PipeChannel(conn), ref_port=ref_port, in_reference=in_reference)


def run_process(
    cfg: DemoConfig, process: int, channel: Channel, *, ref_port: int, in_reference: bool
) -> None:
    """One demo process, however it was started: logs to ``logs/process-<process>.log``, says
    hello, takes part in the reference run when ``in_reference``, then runs the guarded training
    under the wrapper (a spare until it gets a rank) and says how it ended."""
    logs = Path(cfg.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"process-{process}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):  # torch's C++ warnings too: the parent shows a curated view
        os.dup2(fd, target)
    os.close(fd)
    import logging

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s process {process} %(name)s: %(message)s"
    )
    from trainguard import _env

    settings = _env.settings()
    node = int(os.environ.get("GROUP_RANK", "0"))
    channel.send("hello", process, os.getpid(), settings.incarnation, node, os.getppid())
    import torch

    torch.set_num_threads(1)
    from trainguard import events

    try:
        if in_reference:
            t0 = time.time()
            digest = reference(cfg, process, ref_port)
            channel.send("reference", process, digest, time.time() - t0)
        else:  # a spare: import now what a round needs, so taking over a rank is quick
            from trainguard.demo import model as m

            m.warm_up(m.TaskConfig())  # the first optimizer step's imports (seconds)
        events.configure(cfg.events_dir)
        guarded = _Guarded(cfg, process, channel)  # builds the checkpointers
        wrapper = guarded_wrapper(
            ranks=cfg.ranks,
            max_rounds=len(cfg.faults) + 8,
            soft_timeout=cfg.soft_timeout,
            hard_timeout=cfg.hard_timeout,
            heartbeat_timeout=cfg.heartbeat_timeout,
            finalize=guarded.release,
            take_out_stragglers=cfg.take_out_stragglers,
        )
        try:
            result = wrapper(guarded)()
        except BaseException:
            guarded.close(strict=False)
            raise
        guarded.close(strict=True)
        if result is None:
            channel.send("idle", process, time.time())
    except StragglerError as exc:  # taken out by the straggler policy: not a failure
        channel.send("straggler", process, str(exc), time.time())
    except Preempted as exc:  # SIGTERM: the state is saved, the process exits with status 75
        channel.send("stopped", process, exc.step, time.time())
        raise
    except BaseException as exc:
        channel.send("error", process, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        channel.close()
