"""The agreement on live state (a pure function of the ranks' records) and LiveState's checks."""

from __future__ import annotations

import pytest
import torch

from trainguard.errors import ConfigError
from trainguard.live import LiveState
from trainguard.live._plan import FIRST_START, NO_STEP, Record, no_holder, plan


def _recs(*specs: tuple[int, bool, int]) -> list[Record]:
    return [Record(rank, step, torn, group) for rank, (step, torn, group) in enumerate(specs)]


def test_ranks_at_the_newest_untorn_step_keep_their_state() -> None:
    p = plan(_recs((7, False, 0), (7, False, 0), (6, True, 0), (NO_STEP, False, 0)))
    assert p.fallback is None and p.step == 7 and p.newest == 7
    assert p.receivers == [2, 3] and p.donors == {0: [0, 1]}
    # two receivers, two donors: in parallel; a second attempt swaps them
    assert [p.donor(2, 0), p.donor(3, 0)] == [0, 1]
    assert [p.donor(2, 1), p.donor(3, 1)] == [1, 0]
    assert p.donor(2, 2) is None


def test_a_rank_behind_receives_the_newer_step() -> None:
    p = plan(_recs((5, False, 0), (6, False, 0)))
    assert p.step == 6 and p.receivers == [0] and p.donors[0] == [1]


def test_replica_groups_each_need_an_untorn_member() -> None:
    p = plan(_recs((4, False, 0), (4, False, 1), (4, False, 0), (3, True, 1)))
    assert p.fallback is None and p.receivers == [3] and p.donors == {0: [0, 2], 1: [1]}
    lost = plan(_recs((4, False, 0), (3, True, 1)))
    assert lost.fallback is not None and "replica group 1" in lost.fallback
    differ = plan(_recs((4, False, 0), (5, False, 1)))
    assert differ.fallback is not None and "differ" in differ.fallback


def test_nobody_holding_state_is_a_first_start() -> None:
    assert plan(_recs((NO_STEP, False, 0), (NO_STEP, False, 0))).fallback == FIRST_START
    assert (
        plan(
            _recs(
                (NO_STEP, False, 0),
            ),
            round=0,
        ).fallback
        == FIRST_START
    )


def test_nobody_holding_state_in_a_later_round_is_no_first_start() -> None:
    # the ranks that held the state were ended: the fallback says so, not "a first start"
    p = plan(_recs((NO_STEP, False, 0), (NO_STEP, False, 0)), round=10)
    assert p.fallback == no_holder(10) and "first start" not in p.fallback
    assert "round 10" in p.fallback and "gone" in p.fallback


def test_live_state_refuses_bad_registrations() -> None:
    with pytest.raises(ConfigError, match="needs the objects"):
        LiveState()
    with pytest.raises(ConfigError, match="no state_dict"):
        LiveState(model=torch.zeros(3))
    with pytest.raises(ConfigError, match="replica_group"):
        LiveState(model=torch.nn.Linear(2, 2), replica_group=1.5)  # type: ignore[arg-type]
    live = LiveState(model=torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="int >= 0"), live.update(-1):
        pass


def test_update_marks_the_step_and_a_failure_tears_it() -> None:
    live = LiveState(model=torch.nn.Linear(2, 2))
    assert live.step is None and not live.torn
    with live.update(0):
        assert live.torn
    assert live.step == 1 and not live.torn
    with pytest.raises(RuntimeError), live.update(1):
        raise RuntimeError("inside optimizer.step()")
    assert live.step == 1 and live.torn
    live.restored(0)
    assert live.step == 0 and not live.torn


def test_objects_given_every_round_are_checked_before_any_collective() -> None:
    live = LiveState(model=None, optimizer=None)  # names only: the objects come each round
    with pytest.raises(ConfigError, match=r"needs this round's \['model', 'optimizer'\]"):
        live.recover()
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="give every registered object"):
        live.recover(model=net)
    with pytest.raises(ConfigError, match="no state_dict"):
        live.recover(model=net, optimizer=3)
    with pytest.raises(ConfigError, match="registered without objects"):
        live.state_dict()


def test_load_state_dict_leaves_the_state_torn_until_restored() -> None:
    net = torch.nn.Linear(2, 2)
    live = LiveState(model=net)
    with live.update(0):
        pass
    state = live.state_dict()
    live.load_state_dict(state)  # whatever it loads, no record vouches for it any more
    assert live.step == 1 and live.torn
    live.restored(1)
    assert live.step == 1 and not live.torn
