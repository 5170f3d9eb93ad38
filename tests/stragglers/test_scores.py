"""Scores, the measurement, the rate limit and the settings, in one process."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from trainguard.errors import ConfigError, StragglerError
from trainguard.restart import WrapperConfig
from trainguard.stragglers import Stragglers, TakeOutStragglers, _timing, section
from trainguard.stragglers.scores import entry_line, individual, parse_entries, relative


def test_relative_score_names_the_slow_section_against_the_fastest_rank() -> None:
    entries = {
        0: {"step": 0.100, "compute": 0.050},
        1: {"step": 0.100, "compute": 0.065},  # 30 % slower compute
        2: {"step": 0.101, "compute": 0.051},
    }
    scores = relative(entries, floor=0.0)
    assert scores[1].section == "compute" and scores[1].fastest_rank == 0
    assert scores[1].score == pytest.approx(0.075 / 0.090)  # floor: a quarter of the step
    assert scores[0].score == pytest.approx(1.0) and scores[2].score > 0.98
    # the floor keeps microsecond sections from turning noise into scores
    tiny = relative({0: {"x": 1e-6}, 1: {"x": 3e-6}}, floor=0.0005)
    assert tiny[1].score > 0.99
    # and so does a quarter of the fastest step: 2 ms more of a 100 ms step is no straggler
    short = relative({0: {"step": 0.1, "io": 0.001}, 1: {"step": 0.1, "io": 0.003}}, floor=0)
    assert short[1].score == pytest.approx(0.026 / 0.028)
    assert relative({0: {"step": 0.1}, 1: {"step": 0.2}}, 0)[1].score == pytest.approx(
        0.125 / 0.225
    )


def test_individual_score_compares_with_the_rank_s_own_best() -> None:
    best: dict[str, float] = {}
    assert individual({"step": 0.1}, best, 0.0) == (1.0, "step")
    score, where = individual({"step": 0.2, "io": 0.01}, best, 0.0)
    assert (score, where) == (pytest.approx(0.5), "step")
    assert best == {"step": 0.1, "io": 0.01}


def test_entries_read_from_the_store_are_validated() -> None:
    raw = (
        entry_line(3, {"step": 0.1})
        + "not json\n"
        + '{"i": -1, "m": {"step": 0.1}}\n'
        + '{"i": 5, "m": {"step": "x", "io": -1, "ok": 0.2}}\n'
        + '{"i": true, "m": {}}\n'
    ).encode()
    assert parse_entries(raw, limit=8) == {3: {"step": 0.1}, 5: {"ok": 0.2}}
    assert parse_entries(raw, limit=4) == {3: {"step": 0.1}}


def test_timer_records_steps_and_sections_and_ends_windows() -> None:
    ended: list[int] = []
    timer = _timing.Timer(window=4, every=3, on_window=ended.append, cuda=False)
    with section("io"):
        pass  # no timer current: nothing recorded
    _timing.use(timer)
    try:
        for _ in range(7):
            with section("io"):
                time.sleep(0.001)
            timer.step()

        @section("fn")
        def fn() -> int:
            return 7

        assert fn() == 7
    finally:
        _timing.use(None)
    assert ended == [1, 2]
    assert len(timer.samples["io"]) == 4 and len(timer.samples["step"]) == 4
    medians = timer.medians()
    assert 0.001 <= medians["io"] < medians["step"] and "fn" in medians
    with pytest.raises(ConfigError, match="section name"):
        section("step")


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        use_libuv=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )


def test_take_out_rate_limit_holds_across_racing_ranks() -> None:
    store = _store()
    policy = TakeOutStragglers(windows=2, max_per_hour=2)
    won: list[int] = []

    def claim(rank: int) -> None:
        if policy.claim(store.clone(), "p/", rank, now=1000.0):
            won.append(rank)

    threads = [threading.Thread(target=claim, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 2
    assert not policy.claim(store, "p/", 9, now=1000.0 + 3599)
    # an hour later both earlier removals are old: two more, then no more
    assert policy.claim(store, "p/", 9, now=1000.0 + 3601)
    assert policy.claim(store, "p/", 10, now=1000.0 + 3601)
    assert not policy.claim(store, "p/", 11, now=1000.0 + 3602)


def test_the_policy_raises_on_the_rank_it_took_out_only() -> None:
    policy = TakeOutStragglers()
    state = type("S", (), {"initial_rank": 2})()
    policy(state)  # no verdict: nothing
    policy.verdict = "straggler: slow"
    with pytest.raises(StragglerError, match="straggler: slow") as err:
        policy(state)
    assert err.value.causes == {2: "straggler: slow"}
    policy(state)  # raised once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every"),
        ({"window": 0}, "window"),
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"floor": -1}, "floor"),
        ({"take_out": "yes"}, "take_out"),
        ({"cuda": "auto"}, "cuda"),
    ],
)
def test_bad_settings_fail_when_built(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Stragglers(**kwargs)  # type: ignore[arg-type]


def test_bad_policy_and_wrapper_arguments_fail_when_built() -> None:
    with pytest.raises(ConfigError, match="max_per_hour"):
        TakeOutStragglers(max_per_hour=0)
    with pytest.raises(ConfigError, match="stragglers="):
        WrapperConfig(stragglers=0.8)  # type: ignore[arg-type]
    assert Stragglers(every=10).window == 10
