"""Rank assignment, rank filter and retry policies: table-driven unit tests (no processes)."""

from __future__ import annotations

import pytest

import trainguard.restart as tr
from trainguard.errors import ConfigError, RetryLimitError


def layout(previous, present, *, round=1, world=None, info=None):
    return tr.Layout.start(
        round=round,
        initial_world_size=world or len(previous),
        previous=tuple(previous),
        present=set(present),
        info=info,
    )


ASSIGN = [
    # (policy, previous order, present, expected order, expected active, expected spares)
    (tr.ShiftRanks(), [0, 1, 2, 3], [0, 1, 2, 3], (0, 1, 2, 3)),
    (tr.ShiftRanks(), [0, 1, 2, 3], [0, 2, 3], (0, 2, 3)),
    (tr.ShiftRanks(), [0, 1, 2, 3], [1, 2, 3], (1, 2, 3)),
    (tr.ShiftRanks(), [2, 0, 3, 1], [0, 1, 3], (0, 3, 1)),
    (tr.FillGaps(), [0, 1, 2, 3], [0, 1, 2, 3], (0, 1, 2, 3)),
    (tr.FillGaps(), [0, 1, 2, 3], [0, 2, 3], (0, 3, 2)),
    (tr.FillGaps(), [0, 1, 2, 3, 4, 5], [0, 2, 3, 4, 5], (0, 5, 2, 3, 4)),
    (tr.FillGaps(), [0, 1, 2, 3, 4, 5], [0, 1, 4, 5], (0, 1, 4, 5)),
    (tr.FillGaps(), [0, 1, 2, 3], [3], (3,)),
]


@pytest.mark.parametrize(("policy", "previous", "present", "order"), ASSIGN)
def test_assignment(policy, previous, present, order) -> None:
    out = policy(layout(previous, present))
    assert out.order == order
    assert out.active == order and out.spares == ()


FILTER = [
    # (filter, previous, present, active, spares)
    (tr.MaxActiveWorldSize(3), [0, 1, 2, 3], [0, 1, 2, 3], (0, 1, 2), (3,)),
    (tr.MaxActiveWorldSize(3), [0, 1, 2, 3], [0, 2, 3], (0, 2, 3), ()),
    (tr.MaxActiveWorldSize(8), [0, 1, 2], [0, 1, 2], (0, 1, 2), ()),
    (tr.ActiveWorldSizeDivisibleBy(2), [0, 1, 2, 3], [0, 1, 3], (0, 1), (3,)),
    (tr.ActiveWorldSizeDivisibleBy(4), [0, 1, 2, 3], [0, 1, 3], (), (0, 1, 3)),
    (
        tr.Compose(tr.MaxActiveWorldSize(5), tr.ActiveWorldSizeDivisibleBy(2)),
        list(range(8)),
        list(range(8)),
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    ),
]


@pytest.mark.parametrize(("policy", "previous", "present", "active", "spares"), FILTER)
def test_filter(policy, previous, present, active, spares) -> None:
    out = policy(tr.ShiftRanks()(layout(previous, present)))
    assert out.active == active and out.spares == spares


def test_spare_fills_the_hole_with_fill_gaps_and_shifts_with_shift_ranks() -> None:
    # round 0: 0,1,2 active, 3 spare; rank 1 leaves.
    first = tr.MaxActiveWorldSize(3)(tr.ShiftRanks()(layout([0, 1, 2, 3], [0, 1, 2, 3])))
    previous = first.active + first.spares
    fill = tr.Compose(tr.FillGaps(), tr.MaxActiveWorldSize(3))(layout(previous, [0, 2, 3]))
    assert fill.active == (0, 3, 2)  # the spare takes rank 1; rank 2 keeps its number
    shift = tr.Compose(tr.ShiftRanks(), tr.MaxActiveWorldSize(3))(layout(previous, [0, 2, 3]))
    assert shift.active == (0, 2, 3)


GROUPED = [
    # (key, size, present, active, excluded)
    (lambda r: r // 2, 2, [0, 1, 2, 3], (0, 1, 2, 3), ()),
    (lambda r: r // 2, 2, [0, 1, 3], (0, 1), (3,)),
    (lambda r: r // 2, 2, [1, 3], (), (1, 3)),
    ("host", 2, [0, 1, 2], (0, 1), (2,)),
]


@pytest.mark.parametrize(("key", "size", "present", "active", "excluded"), GROUPED)
def test_grouped_by_key(key, size, present, active, excluded) -> None:
    info = {r: {"host": f"node{r // 2}", "local_rank": str(r % 2)} for r in range(4)}
    policy = tr.Compose(tr.GroupedByKey(key, size), tr.ShiftRanks())
    out = policy(layout([0, 1, 2, 3], present, info=info))
    assert out.active == active
    assert out.excluded == excluded and set(out.spares) == set(excluded)


def test_grouped_by_key_names_a_missing_fact() -> None:
    with pytest.raises(ConfigError, match="no fact 'rack'"):
        tr.GroupedByKey("rack", 2)(layout([0, 1], [0, 1], info={0: {}, 1: {}}))


RETRY = [
    # (controller, round, present, stops?)
    (tr.RetryController(max_rounds=3), 2, [0, 1], None),
    (tr.RetryController(max_rounds=3), 3, [0, 1], "max_rounds=3"),
    (tr.RetryController(min_active_world_size=2), 5, [0, 1], None),
    (tr.RetryController(min_active_world_size=3), 5, [0, 1], "min_active_world_size=3"),
]


@pytest.mark.parametrize(("controller", "round", "present", "stops"), RETRY)
def test_retry_controller(controller, round, present, stops) -> None:
    lay = tr.ShiftRanks()(layout([0, 1, 2], present, round=round))
    if stops is None:
        controller(lay)
    else:
        with pytest.raises(RetryLimitError, match=stops):
            controller(lay)


def test_compose_passes_hook_state_along() -> None:
    seen = []
    hook = tr.Compose(lambda s: seen.append(("a", s)), lambda s: seen.append(("b", s)))
    state = tr.RoundState(round=0, initial_rank=1, initial_world_size=2)
    assert hook(state) is state
    assert seen == [("a", state), ("b", state)]
    with pytest.raises(ConfigError, match="not callable"):
        tr.Compose(tr.ShiftRanks(), 3)  # type: ignore[arg-type]


def test_round_state_is_immutable() -> None:
    state = tr.RoundState(round=0, initial_rank=1, initial_world_size=2, gone={1: "x"})
    with pytest.raises(AttributeError):
        state.round = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        state.gone[2] = "y"  # type: ignore[index]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: tr.MaxActiveWorldSize(0), "MaxActiveWorldSize"),
        (lambda: tr.ActiveWorldSizeDivisibleBy(1.5), "ActiveWorldSizeDivisibleBy"),
        (lambda: tr.GroupedByKey("host", 0), "size"),
        (lambda: tr.RetryController(max_rounds=0), "max_rounds"),
        (lambda: tr.RetryController(min_active_world_size=True), "min_active_world_size"),
    ],
)
def test_policy_arguments_are_checked(make, match) -> None:
    with pytest.raises(ConfigError, match=match):
        make()
