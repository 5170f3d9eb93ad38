"""``trainguard launch`` arguments from Slurm's environment: one launcher per node.

Under Slurm, ``srun --ntasks-per-node=1`` starts one ``trainguard launch`` on every node of the
step; each launcher starts that node's workers itself. :func:`slurm_launch_args` turns the
task's ``SLURM_*`` variables into torchrun-style options:

- ``--nnodes``: ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``);
- ``--node-rank``: ``SLURM_NODEID`` (c10d assigns group ranks itself; the value only names
  the node in logs);
- ``--rdzv-backend=c10d`` and ``--rdzv-id``: ``SLURM_JOB_ID``, the same on every node;
- ``--rdzv-endpoint``: the first host of the step's node list (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``), port ``MASTER_PORT`` when set, else 29400;
- ``--rdzv-conf=is_host=1`` on that first host and ``is_host=0`` elsewhere, when
  ``SLURMD_NODENAME`` says which node this is (so the rendezvous store is hosted on the first
  host even when its host name differs from the node name Slurm uses);
- ``--nproc-per-node``: ``SLURM_GPUS_ON_NODE``, when Slurm gave this node GPUs.

Options given after these on the command line override them (argparse keeps the last).
It refuses several tasks per node (``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` /
``SLURM_NTASKS_PER_NODE`` / ``SLURM_LOCALID``) with a :class:`~trainguard.errors.ConfigError`:
each of those launchers would start a full node's workers.

``python -m trainguard.launch.slurm`` prints the options shell-quoted on one line (exit code 2
and the error on stderr otherwise), for ``options="$(python -m trainguard.launch.slurm)"`` and
``eval set -- "$options"`` in a batch script (``examples/slurm/train.sbatch``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping

from trainguard._hostlist import first_host
from trainguard.errors import ConfigError

__all__ = ["DEFAULT_PORT", "slurm_launch_args"]

#: rendezvous port when ``MASTER_PORT`` is not set (torch's c10d default).
DEFAULT_PORT = 29400

_ONE_PER_NODE = (
    "trainguard launch must run as one task per node (it starts that node's workers itself): "
    "start it with `srun --ntasks-per-node=1` and give the workers per node with "
    "--nproc-per-node"
)


def _pick(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    raise ConfigError(
        f"{' / '.join(names)} is not set: run `trainguard launch` inside a Slurm job step "
        "(srun), or give --nnodes, --rdzv-id and --rdzv-endpoint yourself"
    )


def _number(name: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise ConfigError(f"{name}={value!r} is not a number; is this a Slurm job step?")
    return int(value)


def _tasks_per_node(name: str, value: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 1]``: the task counts named in a Slurm tasks-per-node list."""
    counts = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x\d+\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot read {name}={value!r}: expected a list like '1(x4),1'")
        counts.append(int(m.group(1)))
    return counts


def _check_one_task_per_node(env: Mapping[str, str]) -> None:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "").strip()
        if value:  # the first one set describes this step best
            if any(n != 1 for n in _tasks_per_node(name, value)):
                raise ConfigError(f"{_ONE_PER_NODE} (got {name}={value})")
            break
    local = env.get("SLURM_LOCALID", "").strip()
    if local and local != "0":
        raise ConfigError(f"{_ONE_PER_NODE} (this is task SLURM_LOCALID={local} of its node)")


def _port(env: Mapping[str, str]) -> int:
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return DEFAULT_PORT
    if not (value.isascii() and value.isdigit()) or not 0 < int(value) < 65536:
        raise ConfigError(
            f"MASTER_PORT={value!r} is not a port: set a number in 1..65535, or unset it for "
            f"{DEFAULT_PORT}"
        )
    return int(value)


def slurm_launch_args(environ: Mapping[str, str] | None = None) -> list[str]:
    """torchrun-style options for this node's ``trainguard launch`` from ``environ`` (default
    ``os.environ``), see the module docstring. Raises :class:`ConfigError` naming the fix."""
    env = os.environ if environ is None else environ
    _check_one_task_per_node(env)
    nnodes = _number(*_pick(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    node_rank = _number(*_pick(env, "SLURM_NODEID"))
    _, job = _pick(env, "SLURM_JOB_ID", "SLURM_JOBID")
    _, nodelist = _pick(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    host = first_host(nodelist)
    args = [
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-id={job}",
        f"--rdzv-endpoint={host}:{_port(env)}",
    ]
    me = env.get("SLURMD_NODENAME", "").strip()
    if me:
        args.append(f"--rdzv-conf=is_host={int(me == host)}")
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus.isascii() and gpus.isdigit() and int(gpus) > 0:
        args.append(f"--nproc-per-node={int(gpus)}")
    return args


def main() -> int:
    try:
        print(shlex.join(slurm_launch_args()))
    except ConfigError as exc:
        print(f"trainguard.launch.slurm: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
