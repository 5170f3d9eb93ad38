"""A whole-job restart request (coord.escalation) against a real TCPStore: one writer, first
reason wins, per generation, and the Wrapper's request that never imports the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests._dist import free_port
from trainguard import coord
from trainguard.coord.keys import escalate_key


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, use_libuv=True
    )
    yield server
    del server


def test_the_first_reason_wins_per_generation(store: dist.TCPStore) -> None:
    assert coord.escalation_reason(store, "job", 0) is None
    assert coord.escalate(store, "job", 0, "first") is True
    assert coord.escalate(store, "job", 0, "second") is False
    assert coord.escalation_reason(store, "job", 0) == "first"
    assert coord.escalation_reason(store, "job", 1) is None
    assert coord.escalate(store, "job", 1, "") is True  # no reason given: a default one
    assert coord.escalation_reason(store, "job", 1) == "escalation requested"
    assert store.get(escalate_key("job", 0)) == b"first"


def test_the_key_carries_the_job_secret(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_JOB_SECRET", "0123456789abcdef0123")
    coord.escalate(store, "job", 0, "with secret")
    secret_key = escalate_key("job", 0)
    monkeypatch.delenv("TRAINGUARD_JOB_SECRET")
    assert secret_key != escalate_key("job", 0)  # the digest is in the prefix
    assert coord.escalation_reason(store, "job", 0) is None  # not where a keyless reader looks
    assert store.get(secret_key) == b"with secret"


# A Wrapper that gives up under `trainguard launch`: restart's escalate, in a fresh interpreter,
# with the variables the launcher sets. It prints which of our packages it imported.
_GIVE_UP = """
import json, sys
from trainguard.restart import _environment
_environment.escalate(RuntimeError("the job ended"))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("trainguard.launch"))))
"""


def test_the_wrapper_asks_the_launcher_without_importing_it(store: dist.TCPStore) -> None:
    env = {
        **os.environ,
        "TRAINGUARD_AGENT": "tg-test-agent",
        "TRAINGUARD_STORE_ADDR": f"127.0.0.1:{store.port}",
        "TRAINGUARD_GENERATION": "3",
        "TORCHELASTIC_RUN_ID": "wrapped",
    }
    env.pop("TRAINGUARD_JOB_SECRET", None)
    out = subprocess.run(
        [sys.executable, "-c", _GIVE_UP], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []  # restart stands below launch
    assert coord.escalation_reason(store, "wrapped", 3) == "RuntimeError: the job ended"


def test_a_request_to_end_the_job_is_marked_and_its_error_read_back(store: dist.TCPStore) -> None:
    from trainguard.coord.escalation import cannot_start

    assert coord.escalate(store, "job", 0, "ConfigError: bad", fatal=True) is True
    reason = coord.escalation_reason(store, "job", 0)
    assert reason is not None and cannot_start(reason) == "ConfigError: bad"
    assert coord.escalate(store, "job", 1, "a restart") is True
    assert cannot_start(coord.escalation_reason(store, "job", 1) or "") is None


# A Wrapper built with a bad configuration under `trainguard launch`: the ConfigError is raised
# as everywhere, and the launcher was asked to end the job first.
_BAD_WRAPPER = """
import trainguard.restart as tr
from trainguard.errors import ConfigError
try:
    tr.Wrapper(soft_timeout=30, hard_timeout=10)
except ConfigError as exc:
    print("raised", exc)
"""


def test_a_wrappers_config_error_under_the_launcher_asks_it_to_end_the_job(
    store: dist.TCPStore,
) -> None:
    from trainguard.coord.escalation import cannot_start

    env = {
        **os.environ,
        "TRAINGUARD_AGENT": "tg-test-agent",
        "TRAINGUARD_STORE_ADDR": f"127.0.0.1:{store.port}",
        "TRAINGUARD_GENERATION": "0",
        "TORCHELASTIC_RUN_ID": "badcfg",
    }
    env.pop("TRAINGUARD_JOB_SECRET", None)
    out = subprocess.run(
        [sys.executable, "-c", _BAD_WRAPPER], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised soft_timeout=30 s must be shorter"), out.stdout
    reason = coord.escalation_reason(store, "badcfg", 0)
    assert reason is not None
    assert (cannot_start(reason) or "").startswith("ConfigError: soft_timeout=30 s")
    del env["TRAINGUARD_AGENT"]  # not under the launcher: nothing is asked
    env["TORCHELASTIC_RUN_ID"] = "plain"
    out = subprocess.run(
        [sys.executable, "-c", _BAD_WRAPPER], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.startswith("raised"), out.stderr
    assert coord.escalation_reason(store, "plain", 0) is None
