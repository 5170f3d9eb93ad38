"""``trainguard launch``'s command line, options and environment variables."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from trainguard import _env
from trainguard.cli import main as trainguard_main
from trainguard.errors import ConfigError
from trainguard.launch import LaunchOptions
from trainguard.launch.cli import build_parser, normalize, options_from_args

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_options_and_ours_parse_and_the_script_keeps_its_own() -> None:
    args = build_parser().parse_args(
        [
            "--nnodes=2",
            "--nproc-per-node",
            "4",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=host:29400",
            "--max-restarts=2",
            "--tg-respawns=5",
            "--tg-respawn-backoff=1.5",
            "--tg-events-dir=/tmp/ev",
            "train.py",
            "--tg-respawns=9",
            "--lr",
            "0.1",
        ]
    )
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("2", "4", 2)
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--tg-respawns=9", "--lr", "0.1"]
    options = options_from_args(args)
    assert options.respawns == 5 and options.respawn_backoff == 1.5
    assert options.events_dir == "/tmp/ev" and options.store is None


def test_help_documents_every_tg_option() -> None:
    text = build_parser().format_help()
    for flag in (
        "--tg-store",
        "--tg-respawns",
        "--tg-respawn-backoff",
        "--tg-rejoin-timeout",
        "--tg-heartbeat-interval",
        "--tg-heartbeat-timeout",
        "--tg-exit-barrier-timeout",
        "--tg-events-dir",
    ):
        assert flag in text
    assert "trainguard launch" in text and "--nproc-per-node" in text


@pytest.mark.parametrize(
    ("argv", "backend", "endpoint"),
    [
        (["--standalone", "s.py"], "c10d", "localhost:0"),
        (["s.py"], "c10d", "localhost:0"),  # one node, static, no port: as torchrun
        (["--nnodes=2", "--master-port=1234", "s.py"], "static", ""),
        (["--nnodes=2", "s.py"], "static", ""),
    ],
)
def test_normalisation_matches_torchrun(argv: list[str], backend: str, endpoint: str) -> None:
    args = build_parser().parse_args(argv)
    normalize(args)
    assert (args.rdzv_backend, args.rdzv_endpoint) == (backend, endpoint)
    assert args.master_port in (1234, 29500)
    if backend == "c10d":
        assert args.rdzv_id and args.rdzv_id != "none"


def test_options_are_checked_in_order_and_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        LaunchOptions(store="nohost")
    with pytest.raises(ConfigError, match="--tg-respawns"):
        LaunchOptions(respawns=-1)
    with pytest.raises(ConfigError, match="respawn_backoff"):
        LaunchOptions(respawn_backoff=-1)
    with pytest.raises(ConfigError, match="respawn_backoff=90 s must be shorter than rejoin"):
        LaunchOptions(respawn_backoff=90, rejoin_timeout=60)
    with pytest.raises(ConfigError, match="heartbeat_interval=10 s must be shorter than"):
        LaunchOptions(heartbeat_interval=10, heartbeat_timeout=5)
    with pytest.raises(ConfigError, match="exit_barrier_timeout"):
        LaunchOptions(exit_barrier_timeout=0)
    with pytest.raises(TypeError):
        LaunchOptions(None)  # type: ignore[misc]  # keyword-only


def test_options_take_seconds_or_timedelta_and_are_frozen() -> None:
    options = LaunchOptions(
        store="10.0.0.1:29600",
        respawn_backoff=timedelta(0),
        rejoin_timeout=timedelta(minutes=2),
        heartbeat_interval=timedelta(milliseconds=500),
    )
    assert options.store == ("10.0.0.1", 29600)
    assert options.respawn_backoff == 0.0 and options.rejoin_timeout == 120.0
    assert options.heartbeat_interval == 0.5 and options.heartbeat_timeout == 10.0
    assert options.exit_barrier_timeout == 30.0
    with pytest.raises(AttributeError):
        options.respawns = 4  # type: ignore[misc]


def test_run_path_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        trainguard_main(["launch", "--run-path", "train.py"])
    assert exc.value.code == 2
    assert "drop --run-path" in capsys.readouterr().err


def test_a_bad_tg_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        trainguard_main(["launch", "--tg-heartbeat-interval=20", "train.py"])
    assert exc.value.code == 2
    assert "heartbeat_interval=20 s must be shorter" in capsys.readouterr().err


def test_trainguard_launch_runs_a_job_and_returns_its_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("import os, sys; sys.exit(int(os.environ['RANK']) * 0 + 7)\n")
    env_path = f"{ROOT / 'src'}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "launch",
            "--standalone",
            "--nproc-per-node=1",
            "--monitor-interval=0.05",
            "--tg-respawns=0",
            str(script),
        ],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "rank 0 failed (exit code 7)" in proc.stderr


def test_settings_read_the_launcher_variables() -> None:
    s = _env.settings(
        {
            "TRAINGUARD_GENERATION": "2",
            "TRAINGUARD_INCARNATION": "1",
            "TRAINGUARD_AGENT": "tg-agent-123",
        }
    )
    assert (s.generation, s.incarnation, s.agent) == (2, 1, "tg-agent-123")
    assert _env.settings({}).generation is None and _env.settings({}).incarnation == 0
    with pytest.raises(ConfigError, match="TRAINGUARD_INCARNATION"):
        _env.settings({"TRAINGUARD_INCARNATION": "-1"})
