"""The job secret of a launched job: required on several hosts, handed to the workers, in every
launcher key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch._agents import Agents
from trainguard.coord._secret import Handover, source
from trainguard.coord.keys import Keyspace
from trainguard.errors import ConfigError
from trainguard.launch import _keys
from trainguard.launch._jobsecret import establish

ROOT = Path(__file__).resolve().parents[2]
SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither variable set; whatever :func:`establish` puts in ``os.environ`` is undone after
    the test (``setenv`` first: ``delenv`` of an unset variable records nothing to restore)."""
    for name in ("TRAINGUARD_JOB_SECRET", "TRAINGUARD_INSECURE"):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


def _env_without_secret() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRAINGUARD_JOB_SECRET", "TRAINGUARD_INSECURE")
    }
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def test_a_job_on_several_hosts_without_a_secret_refuses_to_start_and_names_the_fix() -> None:
    cmd = [
        sys.executable, "-m", "trainguard.launch", "--nnodes=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=198.18.0.1:29400", "--rdzv-id=nosecret", "train.py",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=_env_without_secret(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    for fix in ("TRAINGUARD_JOB_SECRET", "--tg-secret-file", "--tg-insecure", "openssl rand"):
        assert fix in done.stderr


def test_the_secret_file_must_be_private_and_well_formed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        establish(endpoint="h1:29400", secret_file=str(path), insecure=False)
    path.chmod(0o600)
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="first line"):
        establish(endpoint="h1:29400", secret_file=str(path), insecure=False)
    path.write_text(SECRET + "\n")
    assert establish(endpoint="h1:29400", secret_file=str(path), insecure=False) == "file"
    assert os.environ["TRAINGUARD_JOB_SECRET"] == SECRET


def test_one_host_needs_no_secret_and_insecure_must_be_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert establish(endpoint="127.0.0.1:29400", secret_file=None, insecure=False) == "none"
    assert establish(endpoint="localhost:0", secret_file=None, insecure=False) == "none"
    with pytest.raises(ConfigError):
        establish(endpoint="node1:29400", secret_file=None, insecure=False)
    assert establish(endpoint="node1:29400", secret_file=None, insecure=True) == "insecure"
    assert os.environ["TRAINGUARD_INSECURE"] == "1"


def test_every_launcher_key_carries_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    def keys() -> list[str]:
        run = "job7"
        return [
            _keys.generation_key(run), _keys.escalate_key(run, 0), _keys.node_key(run, 0, 1),
            _keys.ranks_key(run, 0, 1), _keys.exit_key(run, 0, 1), _keys.replaced_key(run, 0, 1),
            _keys.vacant_key(run), _keys.published_key(),
        ]  # fmt: skip

    bare = keys()
    monkeypatch.setenv("TRAINGUARD_JOB_SECRET", SECRET)
    one = keys()
    monkeypatch.setenv("TRAINGUARD_JOB_SECRET", SECRET[::-1])
    other = keys()
    # no key of a job with a secret can be named without it, and no two secrets share one
    assert not set(one) & set(bare) and not set(one) & set(other)
    assert all(SECRET not in k for k in one)  # the digest, never the secret itself


def test_ranks_on_several_hosts_refuse_to_hand_the_secret_over_in_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert source("node1") == "store"
    with pytest.raises(ConfigError, match="TRAINGUARD_INSECURE=1"):
        Handover(Keyspace("j"), "store")
    monkeypatch.setenv("TRAINGUARD_INSECURE", "1")
    Handover(Keyspace("j"), "store")  # asked for: allowed


@pytest.mark.timeout(90)
def test_the_workers_get_the_secret_of_the_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    with Agents(
        tmp_path,
        nodes=1,
        nproc=2,
        worker=["env", str(out)],
        extra=[f"--tg-secret-file={path}"],
        env={"TRAINGUARD_JOB_SECRET": ""},
    ) as job:
        assert job.wait(timeout=60) == [0]
    for rank in (0, 1):
        env = json.loads((out / f"env-{rank}.json").read_text())
        assert env["TRAINGUARD_JOB_SECRET"] == SECRET
