"""Placement of local checkpoint copies by host (CliqueReplication with ``jump=None``).

After spares took over ranks of other hosts (``FillGaps``), ranks are no longer numbered host by
host: placement by rank arithmetic (``jump`` = ranks per host) can then put both copies of a part
on one host. The unit tests check the placement function on such maps; the multi-rank test runs
the scenario with real ranks on loopback, each told its host by ``TRAINGUARD_HOST_NAME``: a
host's spares hold ranks of two different original hosts, the host dies (its local roots are
removed with everything on them), and every part is still loaded from a peer on another host;
one manager re-bound to a new round places by that round's hosts; iterations saved with the old
default still load. The same scenario on emulated hosts: tests/cluster/test_local_ckpt_hosts.py.
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from datetime import timedelta
from pathlib import Path

from tests._dist import run_ranks
from trainguard.checkpoint import CliqueReplication
from trainguard.checkpoint.local.replication import compatible, host_cliques


def _check_partition(cliques: list[list[int]], world: int) -> None:
    members = sorted(m for c in cliques for m in c)
    assert members == list(range(world)), cliques


def _hosts_of(cliques: list[list[int]], hosts: list[str]) -> list[list[str]]:
    return [[hosts[m] for m in c] for c in cliques]


def test_spares_that_took_ranks_of_other_hosts_get_peers_on_other_hosts() -> None:
    # after FillGaps: h1 keeps ranks 0 1, spares on h2 took ranks 4 5, h3 holds ranks 2 3
    hosts = ["h1", "h1", "h3", "h3", "h2", "h2"]
    for factor in (2, 3):
        cliques = host_cliques(hosts, factor)
        _check_partition(cliques, 6)
        assert all(len(c) == factor for c in cliques), cliques
        for on in _hosts_of(cliques, hosts):
            assert len(set(on)) == len(on), (factor, cliques)
    assert host_cliques(hosts, 2) == [[0, 4], [1, 2], [3, 5]]
    # the case: the spares of h3 took rank 1 (of h1) and rank 3 (of h2)
    fill_gaps = ["h1", "h3", "h2", "h3"]
    assert CliqueReplication(2, jump=2).cliques(4) == [[0, 2], [1, 3]]  # both copies on h3
    assert CliqueReplication(2).cliques(4, fill_gaps) == [[0, 1], [2, 3]]
    assert CliqueReplication(2, jump=2).cliques(4, fill_gaps) == [[0, 2], [1, 3]]  # as asked


def test_uneven_hosts_spread_as_far_as_they_can() -> None:
    hosts = ["a", "a", "a", "a", "b", "b", "c", "c"]  # a has half the ranks
    cliques = host_cliques(hosts, 2)
    assert all(hosts[x] != hosts[y] for x, y in cliques), cliques
    # 4 ranks on a, one on b: only one of a's ranks can have its copy elsewhere; a second copy
    # on a itself would not survive a
    assert host_cliques(["a", "a", "a", "a", "b"], 2) == [[0, 4], [1], [2], [3]]
    # one host: nothing to copy to
    assert host_cliques(["x"] * 4, 2) == [[0], [1], [2], [3]]
    # fewer hosts than copies: one copy per host
    assert host_cliques(["a", "b", "a", "b", "a", "b"], 3) == [[0, 1], [2, 3], [4, 5]]


def test_distinct_hosts_whenever_the_counts_allow_it() -> None:
    rng = random.Random(29)
    for _ in range(500):
        factor = rng.choice((2, 3))
        n_hosts = rng.randint(factor, 6)
        names = [f"n{i:02d}" for i in range(n_hosts)]
        hosts = [rng.choice(names) for _ in range(factor * rng.randint(1, 8))]
        cliques = host_cliques(hosts, factor)
        _check_partition(cliques, len(hosts))
        assert cliques == host_cliques(list(hosts), factor)  # a function of the map
        for on in _hosts_of(cliques, hosts):
            assert len(set(on)) == len(on), (hosts, cliques)  # never two on one host
        if max(Counter(hosts).values()) <= len(hosts) // factor:
            assert all(len(c) == factor for c in cliques), (hosts, cliques)


def test_settings_saved_before_host_placement_stay_loadable() -> None:
    by_host = CliqueReplication(2).describe()
    assert compatible("CliqueReplication(factor=2, jump=8)", by_host)  # the old default
    assert compatible(by_host, "CliqueReplication(factor=2, jump=1)")
    assert not compatible("CliqueReplication(factor=1, jump=1)", by_host)  # fewer copies
    assert not compatible(
        "CliqueReplication(factor=2, jump=1)", "CliqueReplication(factor=2, jump=2)"
    )
    assert not compatible("something else", by_host)


# ---------------------------------------------------------------- real ranks, hosts by env

WORLD = 4
ITERS = (1, 2)
#: round 1 of a job of 3 hosts x 2 processes, 4 active ranks: host h3's spares took rank 1 (of
#: h1) and rank 3 (of h2); ranks per host stay 2 (LOCAL_WORLD_SIZE), so jump=2 pairs 1 with 3
SAVE_HOSTS = {0: "h1", 1: "h3", 2: "h2", 3: "h3"}
#: after h3 died: two fresh processes on a new host h4 take ranks 1 and 3
LOAD_HOSTS = {0: "h1", 1: "h4", 2: "h2", 3: "h4"}


def _state(owner: int, iteration: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(owner * 100 + iteration)
    return {"w": torch.randn(64, 32, generator=g), "owner": owner, "iteration": iteration}


def _root(base: str) -> str:
    return os.path.join(base, os.environ["TRAINGUARD_HOST_NAME"], f"rank{os.environ['RANK']}")


def _save_round(base: str) -> dict:
    import torch.distributed as dist

    from trainguard.checkpoint import LocalCheckpointManager

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        with LocalCheckpointManager(
            _root(base), replication=CliqueReplication(factor=2), timeout=60
        ) as mgr:
            for it in ITERS:
                mgr.save(_state(rank, it), it)
            mgr.wait()
            return {"clique": mgr.clique, "hosts": getattr(mgr, "hosts", None)}  # (None: old code)
    finally:
        dist.destroy_process_group()


def _load_round(base: str) -> dict:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint import LocalCheckpointManager

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        with LocalCheckpointManager(
            _root(base), replication=CliqueReplication(factor=2), timeout=60
        ) as mgr:
            found = mgr.find_latest()
            if found is None:
                return {"found": None}
            state = mgr.load(found)
            want = _state(rank, found)
            assert torch.equal(state["w"], want["w"]) and state["owner"] == rank
            return {"found": found, "source": (mgr.last_load or {}).get("source")}
    finally:
        dist.destroy_process_group()


def test_host_of_spares_dies_and_every_part_loads_from_another_host(tmp_path: Path) -> None:
    env = {"LOCAL_WORLD_SIZE": "2"}
    saved = run_ranks(
        _save_round,
        WORLD,
        args=(str(tmp_path),),
        env=env,
        rank_env=lambda r: {"TRAINGUARD_HOST_NAME": SAVE_HOSTS[r]},
        timeout=120,
    )
    cliques = [result.get()["clique"] for result in saved]
    shutil.rmtree(tmp_path / "h3")  # host h3 is lost, with its node-local storage
    loaded = run_ranks(
        _load_round,
        WORLD,
        args=(str(tmp_path),),
        env=env,
        rank_env=lambda r: {"TRAINGUARD_HOST_NAME": LOAD_HOSTS[r]},
        timeout=120,
    )
    values = [result.get() for result in loaded]
    assert [v["found"] for v in values] == [ITERS[-1]] * WORLD, values
    for r in (1, 3):  # the new host's ranks received their parts from a peer on h1 or h2
        source = values[r]["source"]
        assert source is not None and source.startswith("rank "), values
        assert SAVE_HOSTS[int(source.split()[1])] in ("h1", "h2"), values
    for r, clique in enumerate(cliques):  # every clique spans two hosts
        assert len({SAVE_HOSTS[m] for m in clique}) == 2, (r, cliques)
    assert [result.get()["hosts"] for result in saved] == [list(SAVE_HOSTS.values())] * WORLD


def _two_rounds(base: str, port: int) -> dict:
    """Round 0 with ranks numbered host by host, round 1 (a new default group) after spares of
    h3 took ranks 1 and 3: one manager, re-bound by itself, places by the new round's hosts."""
    import torch.distributed as dist

    from trainguard.checkpoint import LocalCheckpointManager

    rank = int(os.environ["RANK"])
    os.environ["TRAINGUARD_HOST_NAME"] = f"h{rank // 2 + 1}"
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    root = os.path.join(base, f"rank{rank}")
    out = {}
    with LocalCheckpointManager(root, replication=CliqueReplication(2), timeout=60) as mgr:
        mgr.save(_state(rank, 1), 1)
        mgr.wait()
        out["first"] = mgr.clique
        dist.destroy_process_group()
        os.environ["TRAINGUARD_HOST_NAME"] = SAVE_HOSTS[rank]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        mgr.save(_state(rank, 2), 2)
        mgr.wait()
        out["second"] = mgr.clique
        out["owners"] = sorted(
            int(name[5:10]) for name in os.listdir(os.path.join(root, "iter_000000000002"))
        )
    dist.destroy_process_group()
    return out


def test_a_new_round_places_by_its_own_hosts(tmp_path: Path) -> None:
    from tests._dist import free_port

    results = run_ranks(
        _two_rounds, WORLD, args=(str(tmp_path), free_port()), env={"LOCAL_WORLD_SIZE": "2"}
    )
    values = [r.get() for r in results]
    assert [v["first"] for v in values] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [v["second"] for v in values] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [v["owners"] for v in values] == [v["second"] for v in values]  # copies went there


def _saved_before_host_placement(base: str) -> dict:
    """Save as the old default did under 2 ranks per host (parts say ``jump=2``), then resume
    with placement by host (same factor: loads) and with one copy (refused)."""
    import torch.distributed as dist

    from trainguard.checkpoint import LocalCheckpointManager
    from trainguard.errors import CheckpointReplicationMismatchError

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    root = _root(base)
    out: dict = {}
    try:
        with LocalCheckpointManager(root, replication=CliqueReplication(2, jump=2)) as mgr:
            mgr.save(_state(rank, 1), 1)
            mgr.wait()
        with LocalCheckpointManager(root, replication=CliqueReplication(2)) as mgr:
            found = mgr.find_latest()
            out["loaded"] = found is not None and mgr.load(found)["owner"] == rank
        with LocalCheckpointManager(root, replication=CliqueReplication(1)) as mgr:
            try:
                mgr.find_latest()
            except CheckpointReplicationMismatchError as exc:
                out["refused"] = str(exc)
    finally:
        dist.destroy_process_group()
    return out


def test_iterations_saved_with_the_old_default_load_by_host(tmp_path: Path) -> None:
    results = run_ranks(
        _saved_before_host_placement,
        WORLD,
        args=(str(tmp_path),),
        env={"LOCAL_WORLD_SIZE": "2"},
        rank_env=lambda r: {"TRAINGUARD_HOST_NAME": f"h{r // 2 + 1}"},
        timeout=120,
    )
    for result in results:
        value = result.get()
        assert value["loaded"] is True, value
        assert "factor=2, jump=2" in value["refused"] and "factor=1, by host" in value["refused"]
