"""The one reader of TRAINGUARD_* variables."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from trainguard import _env
from trainguard.errors import ConfigError


def test_settings_read_known_variables() -> None:
    s = _env.settings(
        {
            "TRAINGUARD_EVENTS_DIR": "/tmp/x",
            "TRAINGUARD_STORE_ADDR": "node1:29500",
            "TRAINGUARD_JOB_ID": " ",
        }
    )
    assert s == _env.Settings(events_dir="/tmp/x", store_addr=("node1", 29500), job_id=None)


@pytest.mark.parametrize("value", ["node1", ":29500", "node1:port", "node1:70000"])
def test_bad_store_addr_names_the_fix(value: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        _env.settings({"TRAINGUARD_STORE_ADDR": value})


def test_reading_the_store_address_stays_on_the_ground_floor() -> None:
    """``_env`` stands below ``coord``: checking ``TRAINGUARD_STORE_ADDR`` imports no part of
    it (the address is parsed by ``trainguard._addr``)."""
    code = (
        "import json, sys\n"
        "from trainguard import _env\n"
        "assert _env.settings().store_addr == ('node1', 29500)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('trainguard.'))))\n"
    )
    env = {**os.environ, "TRAINGUARD_STORE_ADDR": "node1:29500"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["trainguard._addr", "trainguard._env", "trainguard.errors"]


def test_unknown_variable_is_reported_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard._env"):
        _env.settings({"TRAINGUARD_EVENT_DIR": "/tmp/typo"})
        _env.settings({"TRAINGUARD_EVENT_DIR": "/tmp/typo"})
    hits = [r for r in caplog.records if "TRAINGUARD_EVENT_DIR" in r.getMessage()]
    assert len(hits) == 1


def test_every_variable_has_the_prefix() -> None:
    assert all(name.startswith("TRAINGUARD_") for name in _env.VARIABLES)


def test_a_removed_variable_is_refused_unless_it_names_what_is_left(caplog) -> None:
    """``TRAINGUARD_NODE_ARRIVAL=0`` asked for the per-key protocol and
    ``TRAINGUARD_SIDECAR=process`` for a sidecar process per rank, both gone: refused when the
    settings are read, with the fix; the values that name what is left (``1``, ``node``) are
    accepted quietly."""
    with pytest.raises(ConfigError, match=r"TRAINGUARD_NODE_ARRIVAL='0' is no longer .*unset it"):
        _env.settings({"TRAINGUARD_NODE_ARRIVAL": "0"})
    with pytest.raises(ConfigError, match=r"TRAINGUARD_SIDECAR='process' .*node's watcher"):
        _env.settings({"TRAINGUARD_SIDECAR": "process"})
    with caplog.at_level(logging.WARNING, logger="trainguard._env"):
        _env.settings({"TRAINGUARD_NODE_ARRIVAL": "1", "TRAINGUARD_SIDECAR": "node"})
    assert not caplog.records
