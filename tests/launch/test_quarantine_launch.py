"""The launcher's side of quarantine, on one machine (no emulated hosts): the flags are checked
when they are parsed, the workers' Wrapper gets the launcher's policy, the agent learns its
host is out from the node directory, probes it with real processes (a hung one is killed at
its bound), and its verdict is what the ranks' probe reports. The jobs on emulated hosts are
``tests/cluster/test_launch_quarantine_hosts.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch._agents import alive
from trainguard.errors import ConfigError
from trainguard.launch import cli
from trainguard.launch._quarantine import NodeQuarantine, Probe
from trainguard.launch.options import LaunchOptions
from trainguard.restart.config import WrapperConfig
from trainguard.restart.quarantine import AgentVerdict

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tg-quarantine-after=-1"], "--tg-quarantine-after N"),
        (["--tg-quarantine-after=2", "--tg-readmit=sometimes"], "--tg-readmit after"),
        (["--tg-quarantine-after=2", "--tg-readmit-after=0"], "--tg-readmit-after K"),
        (["--tg-quarantine-after=2", "--tg-quarantine-window=0"], "--tg-quarantine-window"),
        (["--tg-quarantine-after=2", "--tg-health-interval=-5"], "health_interval"),
        (["--tg-quarantine-after=2", "--tg-quarantine-file=/no/such/dir/x"], "does not exist"),
        (["--tg-quarantine-file=/tmp/x"], "pass --tg-quarantine-after N"),
        (["--tg-health-check=true"], "pass --tg-quarantine-after N"),
    ],
)
def test_bad_quarantine_flags_are_refused_when_parsed(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--nproc-per-node=1", *flags, "no_such_script.py"])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_the_default_is_off_and_gives_the_workers_nothing() -> None:
    options = cli.options_from_args(cli.build_parser().parse_args(["x.py"]))
    assert options.quarantine_after == 0
    q = NodeQuarantine(options, lambda *a, **k: None, "h", 1)
    assert q.env() == {} and q.dir is None
    q.poll()
    q.close()


def test_a_hung_probe_fails_at_its_bound_and_leaves_no_process(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    probe = Probe("hang", [f"echo $$ > {pids}; sleep 60 & echo $! >> {pids}; wait"], shell=True)
    started = time.monotonic()
    result = probe.run(1.0)
    took = time.monotonic() - started
    assert result == "hang did not return within 1 s"
    assert took < 3.0, took
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in left), "the hung probe's child outlived it"
    assert Probe("fails", ["echo broken >&2; exit 4"], shell=True).run(5) == (
        "fails failed (exit status 4) broken"
    )
    assert Probe("passes", ["true"], shell=True).run(5) is None


def _wait(cond: Any, timeout: float = 40.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {cond}")


def test_the_agent_probes_its_quarantined_host_and_the_ranks_report_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round trip on one node: the workers' policy from the agent's environment, a rank
    tells the node its host is out, the agent probes (failing while a marker exists), then
    two passes in a row: the ranks' probe passes, and the host is back."""
    marker = tmp_path / "broken"
    marker.touch()
    options = LaunchOptions(
        quarantine_after=2,
        quarantine_window=600,
        quarantine_file=str(tmp_path / "exclude"),
        health_interval=0.1,
        readmit_after=2,
        health_check=f"test ! -e {marker}",
        probe_timeout=30,
    )
    seen: list[tuple[str, dict[str, Any]]] = []
    node = NodeQuarantine(options, lambda kind, **f: seen.append((kind, f)), "hx", 1)
    try:
        for name, value in node.env().items():
            monkeypatch.setenv(name, value)
        policy = WrapperConfig().quarantine
        assert policy is not None
        assert (policy.after, policy.window, policy.readmit) == (2, 600.0, 1)
        assert policy.file == tmp_path / "exclude"
        assert [type(p) for p in policy.probes] == [AgentVerdict]
        assert policy.probe(None).endswith("has not probed this host yet")
        policy.tell_node("hx", False, "")
        node.poll()
        assert not node.out and not seen
        policy.tell_node("hx", True, "2 faults within 600 s")
        node.poll()
        assert node.out
        assert seen[0] == (
            "launch_quarantined",
            {"quarantined_host": "hx", "why": "2 faults within 600 s"},
        )
        probes = lambda: [f for k, f in seen if k == "launch_probe"]  # noqa: E731
        _wait(lambda: len(probes()) >= 2)
        assert all(not p["passed"] and "--tg-health-check" in p["result"] for p in probes())
        assert "--tg-health-check" in policy.probe(None)
        marker.unlink()
        _wait(lambda: any(p["passes"] == 2 for p in probes()))
        assert policy.probe(None) == "ok"
        policy.tell_node("hx", False, "")
        node.poll()
        assert not node.out and seen[-1] == ("launch_readmitted", {"quarantined_host": "hx"})
        assert policy.probe(None) != "ok"  # probing starts afresh if it is taken out again
    finally:
        node.close()
    assert node.dir is not None and not node.dir.exists()
    with pytest.raises(ConfigError, match="TRAINGUARD_QUARANTINE"):
        monkeypatch.setenv("TRAINGUARD_QUARANTINE", '{"after": 2}')
        WrapperConfig()
