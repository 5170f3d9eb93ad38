"""Bad Wrapper arguments fail when the Wrapper is built, with a message that names the fix."""

from __future__ import annotations

from datetime import timedelta

import pytest

import trainguard.restart as tr
from trainguard.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"barrier_timeout": 0}, "barrier_timeout=0: must be a positive"),
        ({"completion_timeout": "60"}, "give seconds"),
        ({"barrier_timeout": float("inf")}, "finite"),
        ({"store_timeout": True}, "give seconds"),
        ({"barrier_timeout": 10, "store_timeout": 30}, "lower store_timeout or raise"),
        ({"max_rounds": 5, "retry": tr.RetryController(3)}, "not both"),
        ({"abort_timeout": 120, "barrier_timeout": 60}, "abort_timeout=120 s must be shorter"),
        ({"max_rounds": 0}, "max_rounds"),
        ({"retry": 3}, "RetryController"),
        ({"rank_filter": 3}, "rank_filter=3 is not callable"),
        ({"health_check": "yes"}, "health_check='yes' is not callable"),
        ({"store": "nohost"}, "host:port"),
        ({"store": object()}, "TCPStore"),
        ({"soft_timeout": 10, "hard_timeout": 5}, "soft_timeout=10 s must be shorter than hard"),
        ({"heartbeat_interval": 5, "heartbeat_timeout": 2}, "raise heartbeat_timeout or lower"),
        ({"heartbeat_interval": 2, "soft_timeout": 1}, "lower heartbeat_interval"),
        ({"termination_grace_time": -1}, "termination_grace_time=-1: must be a positive"),
        ({"sidecar": "yes"}, "pass True or False"),
    ],
)
def test_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        tr.Wrapper(**kwargs)


def test_arguments_are_keyword_only_and_timedelta_works() -> None:
    with pytest.raises(TypeError):
        tr.Wrapper(None)  # type: ignore[misc]
    w = tr.Wrapper(barrier_timeout=timedelta(minutes=2), completion_timeout=5.5)
    assert w.config.barrier_timeout == 120.0 and w.config.completion_timeout == 5.5
    w = tr.Wrapper(soft_timeout=timedelta(seconds=2), hard_timeout=timedelta(seconds=3))
    assert (w.config.soft_timeout, w.config.hard_timeout) == (2.0, 3.0)


def test_missing_launch_variables_name_the_fix(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)

    @tr.Wrapper()
    def fn() -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigError, match="set RANK and WORLD_SIZE"):
        fn()


def test_slurm_variables_are_mapped() -> None:
    from trainguard._hostlist import first_host
    from trainguard.restart._environment import detect

    assert first_host("node[03-05,9],gpu1") == "node03"
    assert first_host("gpu1") == "gpu1"
    launch = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "n[10-11]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert launch.master_addr == "n10" and launch.master_port == 24242
    assert launch.job == "4242"


def test_wrapper_takes_exactly_the_config_fields_with_their_defaults() -> None:
    import dataclasses
    import inspect

    params = inspect.signature(tr.Wrapper).parameters
    fields = [f for f in dataclasses.fields(tr.WrapperConfig) if f.init]
    assert list(params) == [f.name for f in fields]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert params["barrier_timeout"].default == 120 and params["sidecar"].default is True
    assert "heartbeat_timeout" in (tr.Wrapper.__doc__ or "")
    config = tr.Wrapper().config
    assert config.barrier_timeout == 120.0 and isinstance(config.rank_assignment, tr.ShiftRanks)
    assert tr.Wrapper(max_rounds=3).config.policies.retry.max_rounds == 3  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        tr.Wrapper(barrier_timeot=3)  # type: ignore[call-arg]


def test_sidecar_config_round_trips_through_json() -> None:
    import json

    from trainguard.coord.keys import Keyspace
    from trainguard.restart.sidecar import SidecarConfig

    cfg = tr.WrapperConfig(rank_filter=tr.MaxActiveWorldSize(2), heartbeat_interval=0.5)
    sent = SidecarConfig.build(
        cfg, rank=1, world=4, keys=Keyspace("job", 2), addr=("h", 5), log_dir=None
    )
    received = SidecarConfig.from_json(json.loads(json.dumps(sent.to_json())))
    assert received == sent and received.keys.prefix == "tg/job/2/"
    assert received.heartbeat_interval == 0.5
    assert isinstance(received.round_policies().rank_filter, tr.MaxActiveWorldSize)
    with pytest.raises(KeyError, match="parent"):
        SidecarConfig.from_json({k: v for k, v in sent.to_json().items() if k != "parent"})
