"""One process of the soak, started by ``bench/soak.py`` (never by hand)::

    python -m bench._soak_worker reference CONFIG PROCESS PORT
    python -m bench._soak_worker guarded CONFIG SEGMENT PROCESS PORT

``reference``: rank ``PROCESS`` of the fault-free run (plain gloo, no checkpoints); writes the
parameters' digest (final, and after each disk-checkpoint step) to ``reference/pPROCESS.json``.

``guarded``: process ``PROCESS`` of job segment ``SEGMENT`` (a fresh set of processes, started
after the previous segment ended). It trains the demo's model under
:class:`trainguard.restart.Wrapper` (``FillGaps``, ``MaxActiveWorldSize(ranks)``, so the last
processes wait as spares), with replicated local checkpoints and disk checkpoints through
:class:`trainguard.checkpoint.AsyncCheckpointer`, resumes each round from the newest of
either, and injects the scheduled faults (:mod:`bench._soak_inject`). After every training
step it appends ``ROUND RANK STEP TIME RSS_KIB`` to ``steps/sSEGMENT-pPROCESS.log``; at its end
it writes ``results/sSEGMENT-pPROCESS.json``: how the wrapper ended, the digest when it
finished, and the threads and file descriptors it left behind.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import _soak_inject as inj
from bench._soak_plan import SoakConfig
from trainguard.demo import faults as demo_faults
from trainguard.demo import worker as demo_worker

if TYPE_CHECKING:
    import torch

    from trainguard.restart import CallWrapper


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def reference(cfg: SoakConfig, process: int, port: int) -> None:
    """The fault-free run: ``cfg.steps`` steps on ``cfg.ranks`` processes, plain gloo; writes
    the final digest and the digest each disk checkpoint must hold."""
    from trainguard.demo import model as m

    at_disk_saves = {}  # step -> digest, what each disk checkpoint must hold

    def after_step(done: int, net: Any) -> None:
        if done % cfg.disk_every == 0:
            at_disk_saves[done] = m.parameters_digest(net)

    digest = m.reference_run(
        process=process, ranks=cfg.ranks, steps=cfg.steps, port=port, after_step=after_step
    )
    out = Path(cfg.out) / "reference"
    out.mkdir(exist_ok=True)
    (out / f"p{process}.json").write_text(
        json.dumps({"final": digest, "disk_saves": at_disk_saves}) + "\n"
    )


class _Job:
    """The training function run under the wrapper, with this process's state across rounds."""

    def __init__(self, cfg: SoakConfig, segment: int, process: int) -> None:
        self.cfg = cfg
        self.segment = segment
        self.process = process
        self.root = cfg.local_root(process)
        steps = Path(cfg.out) / "steps"
        steps.mkdir(exist_ok=True)
        self.log = os.open(
            steps / f"s{segment}-p{process}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        self.resources: list[Any] = []  # this round's checkpointers, closed by release()
        self.disk_writer: int | None = None
        self.round_counts: list[tuple[int, int, int]] = []  # (round, open fds, threads) at entry

    def __call__(self, call: CallWrapper) -> str:
        import torch.distributed as dist

        from trainguard.checkpoint import AsyncCheckpointer, CliqueReplication
        from trainguard.checkpoint import LocalCheckpointManager as Local
        from trainguard.demo import model as m

        cfg = self.cfg
        self.round_counts.append(
            (call.round, len(os.listdir("/proc/self/fd")), threading.active_count())
        )
        inj.free_disk(cfg.disk)  # the operator freed a full disk that may have caused a restart
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        # closed by release(): at the end, or after a fault by the wrapper's finalize hook
        local = Local(
            self.root, replication=CliqueReplication(factor=2, jump=1), keep=2, timeout=30
        )
        self.resources.append(local)
        disk = AsyncCheckpointer(commit_timeout=30)
        self.resources.append(disk)
        self.disk_writer = disk.writer_pid
        task = m.TaskConfig()
        teacher, net = m.make_teacher(task), m.make_model(task)
        opt = m.make_optimizer(net, task)
        first = self._restore(local, net, opt)
        for step in range(first, cfg.steps):
            self._maybe_inject(call, step)
            x, y = m.batch(task, teacher, step, call.rank)
            m.train_step(net, opt, x, y, call.world_size, m.learning_rate(task, step, cfg.steps))
            line = f"{call.round} {call.rank} {step} {time.time():.6f} {_rss_kib()}\n"
            os.write(self.log, line.encode())
            done = step + 1
            if done % cfg.local_every == 0 and done < cfg.steps:
                local.save(m.training_state(net, opt, done), done)
            path = Path(cfg.disk) / f"step_{done:06d}"
            # resumed before a committed disk checkpoint: never saved again (a save to a
            # committed path is refused)
            if done % cfg.disk_every == 0 and done < cfg.steps and not demo_worker.committed(path):
                disk.save(m.training_state(net, opt, done), path)
            self._maybe_free_disk(step)
        local.wait()
        disk.wait()
        digest: str = m.parameters_digest(net)
        self.release(strict=True)
        return digest

    def _restore(self, local: Any, net: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
        """Load the newest checkpoint (local or disk) into ``net`` and ``opt``; its step."""
        import torch

        from trainguard.checkpoint import latest, load

        it = local.find_latest()
        on_disk = latest(self.cfg.disk)
        disk_step = int(on_disk.name.split("_")[-1]) if on_disk is not None else -1
        if it is not None and it >= disk_step:
            state = local.load(it)
        elif on_disk is not None:
            state = load(on_disk)
        else:
            return 0
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        return int(state["step"])

    def release(self, state: Any = None, *, strict: bool = False) -> None:
        """Close this round's checkpointers and process group (the wrapper's finalize hook).

        After a fault, errors of closing are expected (the round's groups were aborted) and
        ignored; at the end of a successful round (``strict``) they are raised.
        """
        resources, self.resources = self.resources, []
        demo_worker.close_round(resources, strict=strict)

    def _maybe_inject(self, call: CallWrapper, step: int) -> None:
        for fault in self.cfg.faults:
            if fault.step != step or fault.rank != call.rank:
                continue
            claim = demo_faults.Fault(fault.step, fault.rank, fault.kind)
            context = {
                "step": step,
                "rank": call.rank,
                "segment": self.segment,
                "process": self.process,
                "round": call.round,
            }
            # Claimed, recorded and carried out, or none of it: an abort (another rank's false
            # hang, say) waits for the section, so a claimed fault is never lost. A hang is
            # only recorded inside it: the hang itself must stay interruptible.
            with call.atomic():
                if not demo_faults.claim(self.cfg.out, claim):
                    continue
                if fault.kind == "hang":
                    inj.record(self.cfg, fault, time=time.time(), **context, injected=True)
                else:
                    inj.inject(
                        self.cfg, fault, context, disk_writer=self.disk_writer, local_root=self.root
                    )
            if fault.kind == "hang":
                demo_faults.inject(claim)

    def _maybe_free_disk(self, step: int) -> None:
        """The operator's part of a full disk: free it ``disk_every`` steps after the fault
        (or at the restart that the fault caused, see ``__call__``)."""
        last = None
        for fault in self.cfg.faults:
            if fault.kind == "diskfull" and fault.step <= step:
                last = fault
        if last is not None and step == last.step + self.cfg.disk_every:
            inj.free_disk(self.cfg.disk)


def _sockets() -> dict[str, str]:
    """socket inode -> "tcp LOCAL_PORT->REMOTE_PORT" (or "unix") for this process's view."""
    found: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                found[cols[9]] = f"tcp {local}->{remote}"
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            found.setdefault(line.split()[6], "unix")
    return found


def _open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    if any(t.startswith("socket:") for t in fds.values()):
        sockets = _sockets()
        for fd, target in fds.items():
            if target.startswith("socket:["):
                fds[fd] = f"{target} {sockets.get(target[8:-1], '?')}"
    return fds


def guarded(cfg: SoakConfig, segment: int, process: int) -> dict[str, Any]:
    """Run the wrapper in this process; what happened, for ``results/``."""
    import multiprocessing.resource_tracker

    from trainguard import events
    from trainguard.errors import RetryLimitError, SidecarLostError

    job = _Job(cfg, segment, process)
    # what lives as long as the process, by design: the event log, multiprocessing's tracker
    events.emit("soak_process_start", segment=segment, process=process)
    multiprocessing.resource_tracker.ensure_running()
    before = _open_fds()
    wrapper = demo_worker.guarded_wrapper(
        ranks=cfg.ranks,
        max_rounds=len(cfg.faults) + 8,
        soft_timeout=cfg.soft_timeout,
        hard_timeout=cfg.hard_timeout,
        heartbeat_timeout=cfg.heartbeat_timeout,
        finalize=job.release,
    )
    result: dict[str, Any] = {"segment": segment, "process": process}
    try:
        digest = wrapper(job)()
        result.update(outcome="done" if digest is not None else "idle", digest=digest)
    except RetryLimitError as exc:
        result.update(outcome="retry-limit", error=str(exc))
    except SidecarLostError as exc:
        result.update(outcome="sidecar-lost", error=str(exc))
    except Exception as exc:
        result.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
    os.close(job.log)
    time.sleep(0.2)  # threads that were told to stop have a moment to end
    gc.collect()  # what only a reference cycle still holds is not left behind
    after = _open_fds()
    result["threads_left"] = [
        t.name for t in threading.enumerate() if t is not threading.current_thread()
    ]
    result["fds_left"] = {fd: target for fd, target in after.items() if before.get(fd) != target}
    result["round_counts"] = job.round_counts
    result["time"] = time.time()
    return result


def main(argv: list[str]) -> int:
    mode, cfg = argv[1], SoakConfig.read(argv[2])
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the driver's stall report
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    if mode == "reference":
        reference(cfg, int(argv[3]), int(argv[4]))
        # Its result is written. torch 2.13 sometimes aborts a plain gloo process at exit,
        # after destroy_process_group ("terminate called without an active exception": a
        # joinable C++ thread destroyed in teardown; 1 run in 4 to 5 of the reference here):
        # leave without the interpreter's teardown, which has nothing left to do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    segment, process, port = int(argv[3]), int(argv[4]), argv[5]
    os.environ.update(
        RANK=str(process),
        WORLD_SIZE=str(cfg.world),
        LOCAL_RANK=str(process),
        LOCAL_WORLD_SIZE=str(cfg.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
    )
    result = guarded(cfg, segment, process)
    out = Path(cfg.out) / "results"
    out.mkdir(exist_ok=True)
    (out / f"s{segment}-p{process}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["outcome"] in ("done", "idle") else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
