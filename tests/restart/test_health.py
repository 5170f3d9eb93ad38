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


def test_a_host_out_for_a_cause_then_seen_elsewhere_is_let_go() -> None:
    # the CI's run: rank 0's fault interrupted the others before they raised the same error
    # (twice), so h1 went out for a software bug; h2 raises it in the next round
    state = _judge(_judge(Health(), _blame("h1", 10), now=10), _blame("h1", 20), now=20)
    assert list(state.out) == ["h1"]
    state = _judge(state, _blame("h2", 30), now=30, raised={"h2": {_blame("h2", 0).cause}})
    assert not state.out and state.freed == ("h1",) and state.back == ()
    assert state.blame is not None and not state.blame.counted  # nor does it count against h2
    assert Health.decode(state.encode()) == state
    # a host out for two causes stays out while one of them was seen on no other host
    state = _judge(Health(), _blame("h1", 10), now=10)
    state = _judge(state, _blame("h1", 20, cause="OSError @ /job/io.py:3"), now=20)
    state = _judge(state, _blame("h2", 30), now=30)
    assert list(state.out) == ["h1"] and state.freed == ()


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


@pytest.mark.parametrize("survivor_first", [False, True], ids=["notice-first", "survivor-first"])
def test_a_death_notice_that_lays_out_the_round_keeps_the_quarantine(
    survivor_first: bool,
) -> None:
    """The sidecar's pickled Quarantine (without probes) and the record it follows: a host out
    in round 1 stays out in round 2 when a death notice completes round 2's barrier, and the
    death is blamed on the dead rank's host, also when a survivor's collective error (raised
    as the dead rank's connections closed) won the round's stop key before the notice."""
    import torch.distributed as dist

    from tests.restart import _faults
    from tests.restart.test_rejoin import TIMEOUTS
    from trainguard.coord.keys import Keyspace
    from trainguard.restart import _records
    from trainguard.restart._book import RoundBook
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.sidecar import SidecarConfig
    from trainguard.restart.sidecar._notice import write_notice
    from trainguard.restart.state import RoundOutcome

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    keys = Keyspace("unit", 0, "s3cret")
    wcfg = tr.WrapperConfig(
        **{**_faults.TIMEOUTS, **TIMEOUTS},
        rank_assignment=tr.FillGaps(),
        rank_filter=tr.MaxActiveWorldSize(3),
        quarantine=tr.Quarantine(after=1, probes=[lambda s: None]),
    )
    cfg = SidecarConfig.build(
        wcfg, rank=3, world=4, keys=keys, addr=("127.0.0.1", store.port), log_dir=None
    )
    books = {
        r: RoundBook(store, keys, 4, wcfg.policies, store_timeout=5.0, writer=r) for r in range(4)
    }
    for n in range(3):
        store.set(keys.pg_addr(n), "127.0.0.1:1")

    def barrier(n: int, ranks: tuple[int, ...]) -> _records.RoundLayout | None:
        raw = None
        for r in ranks:
            books[r].record(n, BarrierRecord(r, f"h{r}", 0))
            raw = books[r].arrive(n) or raw
        return _records.layout(raw) if raw is not None else None

    zero = barrier(0, (0, 1, 2, 3))
    assert zero is not None and list(zero.active) == [0, 1, 2] and list(zero.spare) == [3]
    for book in books.values():
        book.enter(zero)
    books[1].propose(0, RoundOutcome.fault(1, "OSError: ECC (/job/t.py:9 in f)", "OSError"))
    one = barrier(1, (0, 1, 2, 3))
    assert one is not None and list(one.active) == [0, 3, 2] and list(one.spare) == [1]
    assert list((one.health or {})["out"]) == ["h1"]
    for book in books.values():
        book.enter(one)
    # round 1: rank 2's process dies; the others arrive first, the notice completes the barrier
    assert barrier(2, (0, 1, 3)) is None
    if survivor_first:
        torn = "RuntimeError: Connection closed by peer (/v/torch/distributed/c10d.py:3252 in f)"
        books[0].propose(1, RoundOutcome.fault(0, torn, "RuntimeError"))
    write_notice(store, cfg, 2, 1, tuple(one.roster), "killed")
    two = _records.layout(store.get(keys.ready(2)))
    assert two.end is None and 1 not in two.active, two  # h1 is still out
    blame = Health.decode(two.health).blame
    assert blame is not None and (blame.host, blame.kind, blame.rank) == ("h2", "RankGone", 2)
    assert blame.cause == "RankGone", blame  # no place of the survivor's
    assert sorted(Health.decode(two.health).out) == ["h1", "h2"]  # h1 kept, h2 after=1


def test_check_finite_sees_numbers_tensors_and_gradients() -> None:
    import torch

    from trainguard.restart.call import _non_finite

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    assert _non_finite((0.5, torch.ones(3), model.parameters(), torch.arange(3))) == ""
    assert "value 0 is nan" in _non_finite((float("nan"),))
    assert "1 non-finite entries" in _non_finite((torch.tensor([1.0, float("inf")]),))
    assert model.weight.grad is not None
    model.weight.grad[0, 1] = float("nan")
    assert "parameter 0" in _non_finite((1.0, model.parameters()))


def test_a_failed_collective_gives_way_to_a_peer_s_own_error() -> None:
    """Rank 0's failed all_reduce won the stop key, rank 1 raised an OSError of its own in the
    same round: the fault is rank 1's, on its host. Without such a peer, or when the peer's
    error is a failed collective too, the winner keeps the blame."""
    from trainguard.restart._health import judge_round
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.state import RoundOutcome

    torn = "RuntimeError: Connection closed by peer (/v/torch/distributed/c10d.py:3252 in f)"
    outcome = RoundOutcome.fault(0, torn, "RuntimeError")
    info = {0: {"host": "h0"}, 1: {"host": "h1"}, 2: {"host": "h2"}}

    def blamed(raised: dict[int, str]) -> tuple[int, str, str]:
        records = {r: BarrierRecord(r, f"h{r}", 0, raised=raised.get(r)) for r in range(3)}
        health, _ = judge_round(None, None, outcome, records, info, 10.0)
        blame = Health.decode(health).blame
        assert blame is not None
        return blame.rank, blame.host, blame.cause

    collective = "RuntimeError @ /v/torch/distributed/c10d.py:3252"
    own = "OSError @ /job/train.py:12"
    assert blamed({0: collective, 1: own, 2: collective}) == (1, "h1", own)
    assert blamed({0: collective, 2: collective}) == (0, "h0", collective)
    assert blamed({0: collective, 1: "DistBackendError @ /job/train.py:30"})[0] == 0
