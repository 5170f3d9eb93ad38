"""The hosts' record (attribution, quarantine, readmission) and the probes, without ranks:
the clock is passed in; probes are real (a real thread that hangs, a real file system)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import trainguard.restart as tr
from trainguard.errors import ConfigError
from trainguard.restart._attribution import Blame, cause_of, place_of
from trainguard.restart._health import Health
from trainguard.restart.probes import run_probes

WHERE = "ValueError: bad (/job/train.py:12 in step <- /job/train.py:40 in train)"


def _judge(state: Health, blame: Blame | None, now: float, **kw: object) -> Health:
    args: dict[str, object] = {
        "after": 2,
        "window": 100.0,
        "readmit_after": 2,
        "raised": {},
        "probes": {},
        "info": {0: "h0", 1: "h1", 2: "h2"},
    }
    args.update(kw)
    return state.judge(now=now, blame=blame, **args).health  # type: ignore[arg-type]


def _blame(host: str, t: float, cause: str = "ValueError @ /job/train.py:12") -> Blame:
    return Blame(rank=int(host[1:]), host=host, kind="ValueError", cause=cause, time=t)


def test_the_place_is_the_raising_frame_outside_trainguard() -> None:
    assert place_of(WHERE) == "/job/train.py:12"
    assert cause_of("ValueError", WHERE) == "ValueError @ /job/train.py:12"
    assert cause_of("Hang", "hang: no progress for 60 s") == "Hang"
    package = str(Path(tr.__file__).resolve().parents[1])
    inside = f"NonFiniteError: nan ({package}/restart/call.py:180 in check_finite <- /j.py:7 in f)"
    assert place_of(inside) == "/j.py:7"


def test_two_faults_within_the_window_take_a_host_out() -> None:
    state = _judge(Health(), _blame("h1", 10), now=10)
    assert not state.out and state.blame is not None and state.blame.counted
    state = _judge(state, _blame("h1", 20), now=20)
    assert list(state.out) == ["h1"] and state.new == ("h1",)
    assert "2 faults within 100 s" in state.out["h1"]["why"]
    assert Health.decode(state.encode()) == state  # it travels with the published round


def test_faults_further_apart_than_the_window_do_not() -> None:
    state = _judge(Health(), _blame("h1", 10), now=10)
    state = _judge(state, _blame("h1", 200), now=200)
    assert not state.out


def test_a_cause_seen_on_another_host_counts_against_none() -> None:
    state = _judge(Health(), _blame("h1", 10), now=10, raised={"h2": {_blame("h1", 0).cause}})
    assert state.blame is not None and not state.blame.counted
    state = _judge(state, _blame("h1", 20), now=20)
    assert not state.out  # both of h1's faults are the software bug's
    other = _judge(state, _blame("h1", 30, cause="OSError @ /job/io.py:3"), now=30)
    assert not other.out  # one counted fault only


def test_a_quarantined_host_comes_back_after_consecutive_passing_probes() -> None:
    state = _judge(_judge(Health(), _blame("h1", 1), now=1), _blame("h1", 2), now=2)
    state = _judge(state, None, now=3, probes={"h1": ["ok"]})
    state = _judge(state, None, now=4, probes={"h1": ["RuntimeError: sick"]})
    assert state.out["h1"]["passes"] == 0 and "sick" in state.out["h1"]["failed"]
    state = _judge(state, None, now=5, probes={"h1": ["ok"]})
    assert "h1" in state.out
    state = _judge(state, None, now=6, probes={"h1": ["ok"]})
    assert not state.out and state.back == ("h1",)
    state = _judge(state, _blame("h1", 7), now=7)
    assert not state.out  # its count started afresh


def test_readmit_never_keeps_it_out() -> None:
    state = _judge(Health(), _blame("h1", 1), now=1, readmit_after=None)
    state = _judge(state, _blame("h1", 2), now=2, readmit_after=None)
    for t in range(3, 10):
        state = _judge(state, None, now=t, probes={"h1": ["ok"]}, readmit_after=None)
    assert "h1" in state.out


def test_a_gone_rank_is_blamed_on_the_host_it_was_seen_on() -> None:
    state = _judge(Health(), None, now=1)
    assert state.host_of(2) == "h2"
    assert Health.decode({"hosts": "x", "seen": [[1, 2]], "out": [], "blame": 3}) == Health()


def test_a_hung_probe_fails_within_its_bound() -> None:
    release = threading.Event()

    def hangs(state: object) -> None:
        release.wait(60)

    start = time.monotonic()
    result = run_probes([hangs], None, timeout=0.5)
    took = time.monotonic() - start
    release.set()  # let its thread end (the probe itself never would in time)
    assert "did not return within 0.5 s" in result
    assert took < 5, took


def test_the_built_in_probes(tmp_path: Path) -> None:
    assert run_probes([tr.MatmulProbe(32), tr.FsyncProbe(tmp_path)], None, timeout=30) == "ok"
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
    failed = run_probes([tr.FsyncProbe(tmp_path / "missing")], None, timeout=30)
    assert "FileNotFoundError" in failed
    full = run_probes([tr.FreeSpaceProbe(tmp_path, 1 << 62)], None, timeout=30)
    assert "bytes free" in full


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"after": 0}, "after=0"),
        ({"window": -1}, "window"),
        ({"readmit": "sometimes"}, "readmit"),
        ({"probe_timeout": 0}, "probe_timeout"),
        ({"probes": [3]}, "not callable"),
        ({"file": "/no/such/dir/exclude"}, "directory does not exist"),
    ],
)
def test_bad_arguments_are_refused_when_built(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tr.Quarantine(**kwargs)  # type: ignore[arg-type]


def test_the_wrapper_takes_a_quarantine_only() -> None:
    with pytest.raises(ConfigError, match="quarantine="):
        tr.Wrapper(quarantine=2)  # type: ignore[arg-type]
    q = tr.Quarantine(after=3, window=60, readmit="never", health_check=lambda s: None)
    assert q.readmit is None and len(q.probes) == 3
