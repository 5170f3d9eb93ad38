"""slurm_launch_args with fake SLURM_* environments, and examples/slurm/train.sbatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainguard
from trainguard.errors import ConfigError
from trainguard.launch.slurm import slurm_launch_args

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


def _env(**extra: str) -> dict[str, str]:
    """What srun --ntasks-per-node=1 gives the task on the second of three nodes."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08,11]",
        "SLURM_TASKS_PER_NODE": "1(x3)",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": "gpu08",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v != "-"}  # "-": leave it out


#: the options for :func:`_env`
EXPECTED = [
    "--nnodes=3",
    "--node-rank=1",
    "--rdzv-backend=c10d",
    "--rdzv-id=4242",
    "--rdzv-endpoint=gpu07:29400",
    "--rdzv-conf=is_host=0",
]


def test_one_task_per_node() -> None:
    assert slurm_launch_args(_env()) == EXPECTED


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[07-08,11]", "gpu07"),
        ("node001", "node001"),
        ("a[3],b[1-2]", "a3"),
        ("rack-1-[0001-0004]", "rack-1-0001"),
        ("cn5,cn[1-2]", "cn5"),
    ],
)
def test_the_endpoint_is_the_first_host_of_the_node_list(nodelist: str, host: str) -> None:
    args = slurm_launch_args(_env(SLURM_JOB_NODELIST=nodelist, SLURMD_NODENAME=host))
    assert f"--rdzv-endpoint={host}:29400" in args and "--rdzv-conf=is_host=1" in args


def test_step_variables_win_and_master_port_and_gpus_are_used() -> None:
    args = slurm_launch_args(
        _env(
            SLURM_STEP_NODELIST="gpu[08,11]",
            SLURM_STEP_NUM_NODES="2",
            SLURM_STEP_TASKS_PER_NODE="1(x2)",
            SLURM_TASKS_PER_NODE="8(x3)",  # the allocation's, not this step's
            MASTER_PORT="31000",
            SLURM_GPUS_ON_NODE="4",
            SLURMD_NODENAME="-",
        )
    )
    assert args == [
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-id=4242",
        "--rdzv-endpoint=gpu08:31000",
        "--nproc-per-node=4",
    ]


@pytest.mark.parametrize(
    "extra",
    [
        {"SLURM_TASKS_PER_NODE": "4(x3)", "SLURM_NTASKS_PER_NODE": "4"},
        {"SLURM_TASKS_PER_NODE": "1(x2),2"},
        {"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "1(x3)"},
        {"SLURM_TASKS_PER_NODE": "-", "SLURM_NTASKS_PER_NODE": "8"},
        {"SLURM_LOCALID": "3"},
    ],
)
def test_several_tasks_per_node_are_refused(extra: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="ntasks-per-node=1"):
        slurm_launch_args(_env(**extra))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"SLURM_JOB_ID": "-"}, "SLURM_JOB_ID"),
        ({"SLURM_NNODES": "-"}, "srun"),
        ({"SLURM_NODEID": "x"}, "not a number"),
        ({"MASTER_PORT": "70000"}, "1..65535"),
        ({"SLURM_TASKS_PER_NODE": "one"}, "cannot read"),
    ],
)
def test_a_bad_environment_names_the_fix(extra: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        slurm_launch_args(_env(**extra))


def test_the_sbatch_file_parses() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def _fake_tools(bin_dir: Path, out: Path) -> None:
    """``srun`` that runs its command once, here; ``trainguard`` that records its arguments."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "trainguard").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {out}\n')
    # a script, not a link: a link to a venv's python outside the venv loses its packages
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    for tool in ("srun", "trainguard", "python"):
        (bin_dir / tool).chmod(0o755)


def _run_sbatch(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "args"
    _fake_tools(tmp_path / "bin", out)
    src = str(Path(trainguard.__file__).resolve().parents[1])
    full = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": src,
        "HOME": str(tmp_path),
        **env,
    }
    return subprocess.run(
        ["bash", str(SBATCH)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60
    )


def test_the_sbatch_file_starts_one_launcher_with_the_slurm_options(tmp_path: Path) -> None:
    done = _run_sbatch(tmp_path, _env(SLURM_GPUS_ON_NODE="8", SCRIPT="train.py"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "args").read_text().splitlines() == [
        "launch",
        *EXPECTED,
        "--nproc-per-node=8",
        "--max-restarts=3",
        "train.py",
    ]


def test_the_sbatch_file_stops_on_several_tasks_per_node(tmp_path: Path) -> None:
    done = _run_sbatch(tmp_path, _env(SLURM_LOCALID="1"))
    assert done.returncode != 0 and "ntasks-per-node=1" in done.stderr
    assert not (tmp_path / "args").exists()
