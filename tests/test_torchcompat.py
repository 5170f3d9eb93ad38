"""Contract tests of trainguard's torch compatibility module: every private torch API it lists
is there (one test each, failing with the attribute's name and its user), the supported range
is enforced, and the store hosting works on this torch (real servers, real clients)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard import _torchcompat
from trainguard.coord import _bind
from trainguard.errors import ConfigError, UnsupportedTorchError, UntestedTorchWarning


@pytest.mark.parametrize("api", _torchcompat.PRIVATE_APIS, ids=lambda a: a.path)
def test_private_torch_api_is_there(api: _torchcompat.PrivateApi) -> None:
    try:
        found = _torchcompat.resolve(api.path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            f"torch {torch.__version__} has no {api.path} ({exc}); trainguard.{api.where} "
            f"uses it to {api.why}: adapt it in trainguard._torchcompat"
        )
    assert found is not None


def test_every_private_torch_use_in_the_source_is_listed() -> None:
    """A private attribute read from torch, its c10d or rendezvous module or a process group
    in src/ that is not in PRIVATE_APIS fails here (the list stays complete)."""
    import ast
    from pathlib import Path

    src = Path(_torchcompat.__file__).parent
    listed = {a.path.rpartition(":")[2].rpartition(".")[2] for a in _torchcompat.PRIVATE_APIS}
    owners = {"torch", "c10d", "distributed_c10d", "rdzv", "group"}
    used = set()
    for path in src.rglob("*.py"):
        if path.name == "_compat.py":  # the launcher's elastic internals: tests/launch/test_compat
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in owners and not node.attr.startswith("__"):
                used.add(f"{path.relative_to(src)}: {name}.{node.attr}")
    assert {u for u in used if u.rpartition(".")[2] not in listed} == set()


def test_group_internals_used_by_the_abort_are_there() -> None:
    world = _torchcompat.resolve("torch.distributed.distributed_c10d:_world")
    assert isinstance(world.pg_map, dict)
    assert isinstance(world.group_count, int)


def test_an_older_torch_is_refused_with_the_version_needed() -> None:
    floor = ".".join(map(str, _torchcompat.FLOOR))
    with pytest.raises(UnsupportedTorchError, match=rf"needs torch >= {floor}") as info:
        _torchcompat.check_torch("2.5.1+cu121")
    assert isinstance(info.value, ConfigError)


def test_a_newer_torch_warns_and_a_tested_one_is_silent() -> None:
    major, minor = _torchcompat.NEWEST_TESTED
    with pytest.warns(UntestedTorchWarning, match="newer than the newest release"):
        _torchcompat.check_torch(f"{major}.{minor + 1}.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torchcompat.check_torch(f"{major}.{minor}.3")
        _torchcompat.check_torch(torch.__version__)  # the torch the suite runs on is in range


def test_host_store_serves_clients_on_our_listening_socket() -> None:
    fd = _bind.listen("127.0.0.1", 0)
    port = _bind.port_of(fd)
    server = _torchcompat.host_store("127.0.0.1", fd, timeout=timedelta(seconds=10))
    try:
        assert server.port == port
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert server.get("k") == b"v"
        del client
    finally:
        del server


def test_first_use_checks_the_torch_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainguard.restart as tr

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    monkeypatch.setattr(_torchcompat, "_checked", False)
    with pytest.raises(UnsupportedTorchError, match=r"this is torch 2\.5\.1"):
        tr.Wrapper()
    monkeypatch.setattr(torch, "__version__", "99.0.0")
    monkeypatch.setattr(_torchcompat, "_checked", False)
    with pytest.warns(UntestedTorchWarning, match=r"torch 99\.0\.0 is newer"):
        tr.Wrapper()
    tr.Wrapper()  # checked once per process


def test_set_group_timeout_gives_a_gloo_group_its_collective_timeout_back() -> None:
    # restart._setup builds gloo groups with a short timeout and then sets the one asked for:
    # an all-reduce that waits 3 s for a late peer passes on the group set to 30 s and times
    # out on the one left at 1 s (so the test sees the timeout at all)
    from tests._dist import run_ranks
    from tests.restart._stall_jobs import restored_timeout_job

    out = run_ranks(restored_timeout_job, 2, args=(3.0,), timeout=60)[0].get()
    assert out["restored"] is None and out["restored_s"] > 2.0, out
    assert out["short"] is not None and out["short_s"] < 2.9, out


def test_gloo_waits_for_a_peer_to_connect_at_most_the_factor_times_its_timeout() -> None:
    # a peer that published its address and never connects: the waiting rank's constructor
    # raises within GLOO_CONNECT_FACTOR times its timeout (the monitor of restart waits that
    # long for it before it takes the rank for stuck: restart._setup)
    from tests._dist import run_ranks
    from tests.restart._stall_jobs import connect_wait_job
    from trainguard.restart._setup import GLOO_CONNECT_FACTOR

    timeout = 0.5
    results = run_ranks(connect_wait_job, 2, args=(timeout, 2 * GLOO_CONNECT_FACTOR * timeout + 2))
    out = results[0].get()
    assert out["raised"] is not None, out
    assert "Connect timeout" in out["raised"], out
    assert timeout <= out["waited"] <= GLOO_CONNECT_FACTOR * timeout + 1.5, out


class _ExecutorSeen(Exception):
    """Raised by :class:`_Peek` to end the save once its stage() has looked."""


class _Peek:
    """An async stager (DCP's protocol) whose stage() records what
    ``_torchcompat.dcp_async_executor`` finds, then ends the save."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def stage(self, state_dict: dict[str, object]) -> dict[str, object]:
        self.seen.append(_torchcompat.dcp_async_executor())
        raise _ExecutorSeen

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_dcp_async_executor_reads_the_executor_of_the_async_save_calling_a_stager(
    tmp_path,
) -> None:
    # checkpoint.dcp.async_stager refuses the PROCESS executor through this: the argument of
    # torch's async_save, read from its frame while it calls the stager's stage()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    peek = _Peek()
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's warning that no process group is set up
            with pytest.raises(_ExecutorSeen):
                dcp.async_save(
                    {"w": torch.zeros(2)},
                    checkpoint_id=str(tmp_path / kind.value),
                    async_stager=peek,
                    async_checkpointer_type=kind,
                )
    assert peek.seen == ["thread", "process"]
    assert _torchcompat.dcp_async_executor() is None  # outside an async_save
