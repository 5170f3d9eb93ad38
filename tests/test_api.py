"""Public surface: __all__ matches the exports, imports have no side effects, CLI runs."""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import trainguard
from trainguard import errors

PACKAGES = [
    "trainguard",
    "trainguard.checkpoint",
    "trainguard.checkpoint.async_save",
    "trainguard.checkpoint.dcp",
    "trainguard.checkpoint.format.layout",
    "trainguard.checkpoint.format.read",
    "trainguard.checkpoint.format.write",
    "trainguard.checkpoint.local",
    "trainguard.checkpoint.local.manager",
    "trainguard.checkpoint.local.replication",
    "trainguard.checkpoint.staging",
    "trainguard.checkpoint.writer",
    "trainguard.coord",
    "trainguard.coord.escalation",
    "trainguard.demo",
    "trainguard.errors",
    "trainguard.events",
    "trainguard.integrations",
    "trainguard.launch",
    "trainguard.launch.worker",
    "trainguard.live",
    "trainguard.live.state",
    "trainguard.report",
    "trainguard.restart",
    "trainguard.restart.policy",
    "trainguard.stragglers",
    "trainguard.stragglers.config",
    "trainguard.stragglers.round",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_exported(name: str) -> None:
    module = importlib.import_module(name)
    names = list(module.__all__)
    assert names == sorted(names), f"{name}.__all__ is not sorted"
    assert len(set(names)) == len(names)
    for attr in names:
        assert hasattr(module, attr), f"{name}.__all__ names {attr!r} which does not exist"
    public = {
        k
        for k, v in vars(module).items()
        if not k.startswith("_")
        and getattr(v, "__module__", None) == name
        and (isinstance(v, type) or callable(v))
    }
    assert public <= set(names), (
        f"{name} defines public names missing from __all__: {public - set(names)}"
    )


def _all_packages() -> list[str]:
    """Every package under src/trainguard, found on disk (new packages are checked too)."""
    root = Path(trainguard.__file__).parent
    return sorted(
        ".".join(("trainguard", *init.parent.relative_to(root).parts))
        for init in root.rglob("__init__.py")
    )


@pytest.mark.parametrize("name", _all_packages())
def test_every_package_exports_a_sorted_all(name: str) -> None:
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{name}/__init__.py has no __all__"
    assert list(names) == sorted(names), f"{name}.__all__ is not sorted"
    for attr in names:
        assert getattr(module, attr, None) is not None, f"{name}.{attr} does not resolve"


def test_import_has_no_side_effects() -> None:
    code = (
        "import logging, sys, threading\n"
        "before = set(sys.modules)\n"
        "import trainguard, trainguard.events, trainguard.errors, trainguard.restart, trainguard.coord\n"
        "import trainguard, trainguard.events, trainguard.errors\n"
        "import trainguard.checkpoint, trainguard.checkpoint.local, trainguard.report\n"
        "import trainguard.launch, trainguard.launch.worker, trainguard.restart.sidecar\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert not logging.getLogger().handlers\n"
        "assert 'torch' not in sys.modules, 'importing trainguard must not import torch'\n"
        "assert 'matplotlib' not in sys.modules, 'only --plot imports matplotlib'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    assert not logging.getLogger("trainguard").handlers


def test_internal_faces_say_so() -> None:
    """``restart.sidecar`` exports nothing public (its names serve restart and launch only);
    ``coord`` is public but low level, and its face says that it may change."""
    import trainguard.coord
    import trainguard.restart.sidecar as sidecar

    assert sidecar.__all__ == []
    assert sidecar.__doc__ is not None and "Internal to trainguard" in sidecar.__doc__
    for name in ("SidecarConfig", "SidecarService"):
        assert getattr(sidecar, name).__module__.startswith("trainguard.restart.sidecar.")
    doc = " ".join((trainguard.coord.__doc__ or "").split())
    assert "low-level layer" in doc and "may change" in doc


def test_error_tree_and_causes_survive_pickling() -> None:
    import pickle

    for cls in (
        errors.ConfigError,
        errors.CoordinationError,
        errors.RestartError,
        errors.CheckpointError,
    ):
        assert issubclass(cls, errors.TrainguardError)
    assert issubclass(errors.ConfigError, ValueError)
    err = errors.RestartError("too few ranks left", causes={2: "SIGKILL", 0: "ValueError: x"})
    text = str(err)
    assert text.splitlines() == [
        "too few ranks left",
        "  rank 0: ValueError: x",
        "  rank 2: SIGKILL",
    ]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.RestartError and back.causes == err.causes and str(back) == text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_version_and_help() -> None:
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"trainguard {trainguard.__version__}"
    out = _cli("--help")
    assert out.returncode == 0 and "events" in out.stdout and "usage: trainguard" in out.stdout
    assert "report" in out.stdout


def test_cli_events_merges_a_run(tmp_path) -> None:
    from trainguard.events import EventLog

    with EventLog(tmp_path, rank=1) as log:
        log.emit("fault", cause="ValueError")
        log.emit("restart", duration=0.002)
    out = _cli("events", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    kinds = [json.loads(line)["kind"] for line in out.stdout.splitlines()]
    assert kinds == ["fault", "restart"]
    out = _cli("events", str(tmp_path), "--kind", "restart")
    assert out.returncode == 0 and "restart" in out.stdout and "fault" not in out.stdout
    assert "2.00 ms" in out.stdout
    out = _cli("events", str(tmp_path / "empty"))
    assert out.returncode == 1 and "no events" in out.stderr
