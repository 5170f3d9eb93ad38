"""``trainguard launch``: torchrun's command line, run by the trainguard agent.

torch's own parser (``torch.distributed.run.get_args_parser``) with the ``--tg-*`` options added,
torch's argument normalisation (``--standalone``, single-node static rendezvous -> c10d, the
default master port), torch's ``config_from_args``; then :func:`launch_agent`, which builds what
torch's ``launch_agent`` builds but runs :class:`~trainguard.launch.agent.TrainguardAgent`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainguard.errors import ConfigError, NodeLeftError, RestartError
from trainguard.launch._jobsecret import establish
from trainguard.launch.options import LaunchOptions
from trainguard.restart.preempt import EXIT_PREEMPTED, Preempted

if TYPE_CHECKING:
    from trainguard.launch.agent import TrainguardAgent

__all__ = [
    "build_agent",
    "build_parser",
    "launch_agent",
    "main",
    "missing_script",
    "normalize",
    "options_from_args",
]

logger = logging.getLogger(__name__)

#: exit status of a node that left a running job (:class:`~trainguard.errors.NodeLeftError`):
#: the job goes on without it.
EXIT_LEFT = 3

#: torchrun's default master port (static rendezvous).
DEFAULT_MASTER_PORT = 29500


#: the ``--tg-*`` options: LaunchOptions field, type, default, metavar, help.
TG_OPTIONS: list[tuple[str, type, Any, str, str]] = [
    ("store", str, None, "HOST:PORT", "external coordination store (default: "
     "TRAINGUARD_STORE_ADDR, else the agent of group rank 0 hosts one, listening on the "
     "rendezvous interface)"),
    ("respawns", int, 3, "N", "respawns of one worker slot per generation before the whole "
     "job restarts (default 3; 0: every death restarts the job)"),
    ("respawn_backoff", float, 0.0, "S", "seconds before a slot's first respawn; each later "
     "one waits twice as long, from 0.5 s when this is 0 (default 0: at once)"),
    ("rejoin_timeout", float, 60.0, "S", "how long the other workers wait for a respawned "
     "worker before they continue without it (default 60)"),
    ("heartbeat_interval", float, 1.0, "S", "seconds between two heartbeats of a node "
     "(default 1)"),
    ("heartbeat_timeout", float, 10.0, "S", "a node without a heartbeat for this long is lost "
     "(default 10); also bounds the agent's coordination store operations"),
    ("exit_barrier_timeout", float, 30.0, "S", "how long an agent whose workers finished "
     "waits for the other agents (default 30; torch's is 300)"),
    ("events_dir", str, None, "DIR", "event log directory of the agents and their workers "
     "(default: TRAINGUARD_EVENTS_DIR)"),
    ("on_evicted", str, "rejoin", "{rejoin,exit}", "what a node declared lost does when it "
     "reaches the store again: rejoin as a new node (default) or exit with status 3"),
    ("secret_file", str, None, "PATH", "file (mode 600, the same on every node) whose first line "
     "is the job secret; default TRAINGUARD_JOB_SECRET; a job on several hosts needs one"),
    ("insecure", bool, False, "", "let a job on several hosts run without a job secret (any "
     "host that reaches its stores can read and forge its keys)"),
    ("fence_timeout", float, 300.0, "S", "how long a node that cannot reach the coordination "
     "store (it stopped its workers) waits for it before it leaves the job (default 300)"),
    ("preemption_grace", float, None, "S", "seconds from a SIGTERM to the end of the workers, "
     "which stop at an agreed step and save it; the launcher then exits with status 75 "
     "(requeue); default TRAINGUARD_PREEMPTION_GRACE, else 60"),
    ("warm_workers", int, 0, "N", "worker processes per node started ahead, past their "
     "imports, waiting: a respawn takes one over instead of a cold start (default 0)"),
    ("quarantine_after", int, 0, "N", "take a host out of the job after N faults attributed "
     "to it within --tg-quarantine-window: its ranks go to spares, its agent stops respawning "
     "its workers and probes it (default 0: off; see docs/launch.md#bad-hosts)"),
    ("quarantine_window", float, 3600.0, "S", "seconds within which the faults of "
     "--tg-quarantine-after count (default 3600)"),
    ("quarantine_file", str, None, "PATH", "file the quarantined hosts are written to, one a "
     "line (for the scheduler's exclude list)"),
    ("health_interval", float, 60.0, "S", "seconds between two probe rounds on a quarantined "
     "host (default 60)"),
    ("readmit_after", int, 3, "K", "a quarantined host is back as a spare after K passing "
     "probe rounds in a row (default 3)"),
    ("readmit", str, "after", "{after,never}", "never: a quarantined host stays out for the "
     "rest of the job (default after: see --tg-readmit-after)"),
    ("health_check", str, None, "CMD", "shell command run as one more probe on a quarantined "
     "host (exit status 0: healthy)"),
    ("probe_timeout", float, 30.0, "S", "the longest one probe may run; a probe that hangs "
     "longer failed (default 30)"),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus the ``--tg-*`` options (they go before the script's name)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "trainguard launch"
    parser.description = (
        "Start a training script like torchrun does (same options, same worker environment); "
        "a worker that dies is respawned alone while the others keep running, and the whole "
        "job restarts (a new generation) only when that cannot help."
    )
    tg = parser.add_argument_group("trainguard", "what trainguard launch adds to torchrun")
    for field, kind, default, metavar, text in TG_OPTIONS:
        flag = "--tg-" + field.replace("_", "-")
        if kind is bool:
            tg.add_argument(flag, dest=f"tg_{field}", action="store_true", help=text)
            continue
        tg.add_argument(
            flag, dest=f"tg_{field}", type=kind, default=default, metavar=metavar, help=text
        )
    return parser


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`LaunchOptions` of parsed ``--tg-*`` arguments."""
    return LaunchOptions(**{field: getattr(args, f"tg_{field}") for field, *_ in TG_OPTIONS})


def normalize(args: argparse.Namespace) -> None:
    """What torchrun's ``run()`` does to its arguments before ``config_from_args``."""
    from torch.distributed.run import parse_min_max_nnodes

    one_node_static = (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    )
    if args.standalone or one_node_static:  # one node: a c10d rendezvous on a free port
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = DEFAULT_MASTER_PORT


def missing_script(args: argparse.Namespace) -> str | None:
    """Why the workers' script (or, with ``--no-python``, command) cannot start, or ``None``:
    a start that would fail on every worker and every restart fails here, once."""
    if args.module:  # found through the workers' sys.path: only they can tell
        return None
    script = str(args.training_script)
    if args.no_python and os.sep not in script:
        if shutil.which(script) is None:
            return (
                f"the command {script!r} does not exist on PATH: pass a command the workers can run"
            )
        return None
    if os.path.isfile(script):
        return None
    return (
        f"the training script {script!r} does not exist (looked in {os.getcwd()}): pass the "
        "path of the script the workers run"
    )


def _static_master(backend: str, endpoint: str) -> tuple[str | None, int | None]:
    """``MASTER_ADDR``/``MASTER_PORT`` fixed by a static rendezvous; ``None`` otherwise."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if backend != "static":
        return None, None
    if not endpoint.strip():
        raise ConfigError("static rendezvous needs an endpoint: pass --master-addr/--master-port")
    host, port = parse_rendezvous_endpoint(endpoint.strip(), default_port=-1)
    if port == -1:
        raise ConfigError(f"no port in rendezvous endpoint {endpoint!r}: pass --master-port")
    return host, port


def _entrypoint_name(entrypoint: str, args: Sequence[Any]) -> str:
    if os.path.basename(entrypoint).startswith("python"):
        script = next((str(a) for a in args if not str(a).startswith("-")), entrypoint)
        return os.path.basename(script)
    return os.path.basename(entrypoint)


#: WorkerSpec fields torch copies from the LaunchConfig field of the same name.
_SPEC_FROM_CONFIG = (
    "max_restarts",
    "monitor_interval",
    "local_addr",
    "event_log_handler",
    "numa_options",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
)


def build_agent(
    config: Any, entrypoint: str, args: Sequence[Any], options: LaunchOptions
) -> TrainguardAgent:
    """The agent torch's ``launch_agent`` would build for ``config`` (a torch ``LaunchConfig``),
    as a :class:`TrainguardAgent`: rendezvous handler from torch's registry (for c10d: wrapped
    in the admission gate, so that a replacement node neither restarts the running job nor
    waits for a rendezvous round), ``WorkerSpec``, the node heartbeat."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from trainguard.launch._gate import create_gated_handler
    from trainguard.launch.agent import TrainguardAgent

    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    # torch's shared agent store leaks one attempt's keys into the next (a restarted gloo
    # group hangs); workers host their own bootstrap store unless the user chose otherwise.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    handler: RendezvousHandler
    if config.rdzv_backend == "c10d":
        handler = create_gated_handler(params)
    else:  # no vacancies: a node lost stays lost until the next whole-job restart
        handler = rdzv_registry.get_rendezvous_handler(params)
    master_addr, master_port = _static_master(config.rdzv_backend, config.rdzv_endpoint)
    same = {name: getattr(config, name) for name in _SPEC_FROM_CONFIG}
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        master_addr=master_addr,
        master_port=master_port,
        **same,
    )
    agent = TrainguardAgent(
        spec,
        config.logs_specs,
        options=options,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
    )
    agent.heartbeat_factory = TrainguardAgent.node_heartbeat
    return agent


def launch_agent(
    config: Any, entrypoint: str, args: Sequence[Any], options: LaunchOptions
) -> dict[int, Any]:
    """Run one :class:`TrainguardAgent` (:func:`build_agent`) until the job ends; returns the
    workers' results by global rank. A failed job raises torch's ``ChildFailedError`` (naming
    the first failed worker), or :class:`RestartError` when the job failed without a local
    worker failure (another node escalated, no restart left). On a signal the rendezvous stays
    open, as torch keeps it."""
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    agent = build_agent(config, entrypoint, args, options)
    spec = agent.get_worker_group().spec
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result is None:  # the rendezvous was closed: nothing to run
            return {}
        if agent.preempted and not result.is_failed():  # the workers saved and ended: 75
            shutdown_rdzv = False  # the requeued job uses the same rendezvous id
            raise Preempted(None, True)
        if agent.partition.left is not None:
            raise NodeLeftError(agent.partition.left)
        if agent.cannot_start is not None:  # the worker printed its error: not again
            kind = agent.cannot_start.partition(":")[0]
            raise ConfigError(
                f"the job cannot start: a worker raised {kind} before its first round (its "
                "traceback is in the workers' output, its message in the event log "
                "launch_cannot_start); fix it and start the job again (no respawn, no restart)"
            )
        if result.is_failed() and result.failures:
            raise ChildFailedError(
                name=_entrypoint_name(entrypoint, args), failures=result.failures
            )
        if result.is_failed():
            raise RestartError(
                f"the job needed a whole-job restart ({agent.last_escalation}) and no restart "
                "is left; raise --max-restarts to let it restart"
            )
        return dict(result.return_values)
    except ChildFailedError:
        raise
    except SignalException:
        shutdown_rdzv = False  # closing it would end this rendezvous id for good
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        if agent.preempted:
            raise Preempted(None, True) from None
        raise
    except Exception:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        else:  # the rendezvous stays open, but this node's keep-alive writes end here: a
            # daemon thread inside a C++ store call while the interpreter exits aborts it
            from trainguard.launch import _compat
            from trainguard.launch._gate import AdmissionGate

            handler = spec.rdzv_handler
            _compat.stop_keepalive(
                handler.handler if isinstance(handler, AdmissionGate) else handler
            )


def main(argv: Sequence[str] | None = None) -> int:
    """``trainguard launch ARGS``; returns the exit code (1 when the job failed, as torchrun;
    75 when it was preempted and its workers saved their state: requeue it)."""
    from trainguard import _torchcompat

    _torchcompat.check_torch()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import config_from_args

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.run_path:
        parser.error(
            "--run-path runs the script inside the agent's worker pool (a Python function), "
            "whose workers cannot be replaced one at a time; drop --run-path"
        )
    try:
        options = options_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    normalize(args)
    try:
        establish(
            endpoint=args.rdzv_endpoint or "",
            secret_file=options.secret_file,
            insecure=options.insecure,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    missing = missing_script(args)
    if missing is not None:
        parser.error(missing)
    config, cmd, cmd_args = config_from_args(args)
    if not isinstance(cmd, str):  # pragma: no cover - only --run-path gives a function
        parser.error("trainguard launch runs a command per worker; drop --run-path")
    try:
        record(launch_agent)(config, cmd, cmd_args, options)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(
            f"trainguard launch: rank {rank} failed (exit code {failure.exitcode}); the job ended",
            file=sys.stderr,
        )
        return 1
    except NodeLeftError as exc:
        print(f"trainguard launch: this node left the job: {exc}", file=sys.stderr)
        return EXIT_LEFT
    except Preempted:
        print(
            f"trainguard launch: preempted; the workers saved their state (exit status "
            f"{EXIT_PREEMPTED}: requeue the job to resume)",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    except SignalException as exc:
        print(f"trainguard launch: stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"trainguard launch: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
