"""What the launcher told this process, and the environment of each round.

Understands the standard variables set by torchrun and plain launchers (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and Slurm's (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_JOB_NODELIST, SLURM_JOB_ID).

The job token names one attempt of the job: under ``trainguard launch`` it ends with
``-g<generation>`` (``TRAINGUARD_GENERATION``, bumped at each whole-job restart), under plain
torchrun with ``-a<restart count>`` (``TORCHELASTIC_RESTART_COUNT``), so that no key of an
earlier attempt is on the path of a new one (torchrun reuses its agent store across restarts).
``TRAINGUARD_INCARNATION`` (k for the k-th respawn of a rank by the launcher) makes the
process a newcomer that joins the running job (:mod:`._join`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping

from trainguard import _env
from trainguard._hostlist import first_host
from trainguard.coord.escalation import ask_launcher
from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts a store at MASTER_ADDR:MASTER_PORT
    job: str
    incarnation: int = 0  # k > 0: the k-th respawn of this rank (it joins the running job)
    node: int | None = None  # the node (GROUP_RANK, SLURM_NODEID) of this rank, where known


def attempt_suffix(env: Mapping[str, str], generation: int | None) -> str:
    """``-g<generation>`` under ``trainguard launch``, ``-a<count>`` under plain torchrun,
    else ``""``: what makes the job token unique to one attempt of the job."""
    if generation is not None:
        return f"-g{generation}"
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    if restarts and not restarts.isdigit():
        raise ConfigError(
            f"TORCHELASTIC_RESTART_COUNT={restarts!r} must be an integer >= 0; unset it"
        )
    return f"-a{restarts}" if restarts else ""


def detect(environ: Mapping[str, str] | None = None) -> Launch:
    env = os.environ if environ is None else environ

    def pick(*names: str) -> str | None:
        for name in names:
            value = env.get(name, "").strip()
            if value:
                return value
        return None

    rank = pick("RANK", "SLURM_PROCID")
    world = pick("WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise ConfigError(
            "cannot tell this process's rank: set RANK and WORLD_SIZE (torchrun and "
            "tests/_dist.py do) or run under Slurm srun"
        )
    local = pick("LOCAL_RANK", "SLURM_LOCALID") or "0"
    addr = pick("MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):
        addr = first_host(env["SLURM_JOB_NODELIST"])
    port = pick("MASTER_PORT")
    if port is None and env.get("SLURM_JOB_ID", "").isdigit():
        port = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    if addr is None or port is None or not port.isdigit():
        raise ConfigError(
            "cannot tell where rank 0 is: set MASTER_ADDR and MASTER_PORT (or run under "
            "torchrun or Slurm)"
        )
    settings = _env.settings(env)
    job = settings.job_id or pick("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID") or f"{addr}-{port}"
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job) + attempt_suffix(env, settings.generation)
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    node = pick("GROUP_RANK", "SLURM_NODEID")
    return Launch(
        int(rank),
        int(world),
        int(local),
        addr,
        int(port),
        agent,
        job,
        settings.incarnation,
        int(node) if node is not None and node.isdigit() else None,
    )


def round_variables(rank: int | None, world_size: int, local_rank: int, pg: str) -> dict[str, str]:
    """The launcher's variables a round's function sees: its rank and world size, and the
    round's own store at ``pg`` (``host:port``) as the rendezvous (the agent's store)."""
    host, _, port = pg.rpartition(":")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


@contextlib.contextmanager
def round_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set the round's variables in ``os.environ``; restore the previous values after, and
    this thread's autograd mode as it was before the round.

    The abort unwinds the training function with an exception raised at any bytecode: one that
    lands between a ``torch.no_grad()`` (or an optimizer step's own grad-mode switch) and the
    ``try`` that would undo it leaves gradients off in this thread for good, and every later
    round fails the same way in ``backward()``."""
    saved = {name: os.environ.get(name) for name in values}
    torch = sys.modules.get("torch")
    grad = torch.is_grad_enabled() if torch is not None else None
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch = sys.modules.get("torch")
        wanted = grad is not False  # torch's default where it was not imported yet
        if torch is not None and torch.is_grad_enabled() != wanted:
            logger.warning("the round left autograd %s; restored", "on" if not wanted else "off")
            torch.set_grad_enabled(wanted)


def escalate(exc: BaseException) -> None:
    """Under ``trainguard launch``: in-process restart cannot cure ``exc`` (the job ended), so
    ask the launcher for a whole-job restart (a new generation, state from checkpoints; the
    job fails when torchrun's ``--max-restarts`` has none left;
    :mod:`trainguard.coord.escalation`). Elsewhere nothing."""
    if _env.settings().agent is None:
        return
    try:
        ask_launcher(f"{type(exc).__name__}: {exc}"[:2000])
        logger.error("the job ended (%s); asked the launcher to restart the whole job", exc)
    except Exception as failed:
        logger.error("could not ask the launcher for a whole-job restart: %s", failed)


def cannot_start(exc: BaseException) -> None:
    """Under ``trainguard launch``: ``exc`` was raised before the first round (the Wrapper's
    configuration), so every respawn and every whole-job restart would raise it again: ask the
    launcher to end the job at once (:mod:`trainguard.coord.escalation`). Elsewhere nothing;
    the caller raises ``exc`` after it either way."""
    if _env.settings().agent is None:
        return
    try:
        ask_launcher(f"{type(exc).__name__}: {exc}"[:2000], timeout=5.0, fatal=True)
    except Exception as failed:
        logger.error("could not ask the launcher to end the job: %s", failed)
