"""Slurm host lists (trainguard._hostlist)."""

from __future__ import annotations

import pytest

from trainguard._hostlist import expand, first_host
from trainguard.errors import ConfigError
from trainguard.launch.slurm import slurm_launch_args


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu1", ["gpu1"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("a[01-03,07],b5", ["a01", "a02", "a03", "a07", "b5"]),
        ("node[03-05,9],gpu1", ["node03", "node04", "node05", "node9", "gpu1"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[8-11]", ["x8", "x9", "x10", "x11"]),
        ("h1,h2,h3", ["h1", "h2", "h3"]),
    ],
)
def test_a_node_list_expands_to_its_hosts_in_order(nodelist: str, hosts: list[str]) -> None:
    assert expand(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["", "a[1-2", "a]1[", "a[2-1]", "a[x]", "a,,b", "a[[1]]"])
def test_a_broken_node_list_is_a_config_error_naming_the_fix(bad: str) -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        expand(bad)


def test_the_launcher_s_rendezvous_endpoint_is_the_first_host_with_its_suffix() -> None:
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "node[1-2]-ib",
        "SLURMD_NODENAME": "node2-ib",
    }
    args = slurm_launch_args(env)
    assert "--rdzv-endpoint=node1-ib:29400" in args
    assert "--rdzv-conf=is_host=0" in args
