"""Local checkpoints across 4 real ranks (gloo, TCPStore) through tests/_dist.py.

Layout under test: 4 ranks as 2 "nodes" of 2 (each rank names its node in TRAINGUARD_HOST_NAME:
ranks 0 1 on node0, 2 3 on node1), CliqueReplication(factor=2) by host, so the cliques are
{0, 2} and {1, 3}: each part lives on its owner and on the
rank two away. One save phase (iterations 1..3) builds the roots once for the module; each test
works on a copy and damages it before the ranks recover.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests._dist import RankGroup, run_ranks
from trainguard.events import read_events

WORLD = 4
ITERS = (1, 2, 3)
ENV = {"LOCAL_WORLD_SIZE": "2"}


def on_node(rank: int) -> dict[str, str]:
    """Ranks 0 1 on "node0", 2 3 on "node1" (the host each reports for placing copies)."""
    return {"TRAINGUARD_HOST_NAME": f"node{rank // 2}"}


def part_state(owner: int, iteration: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(owner * 1000 + iteration)
    return {
        "model": {"w": torch.randn(256, 512, generator=g), "b": torch.randn(512, generator=g)},
        "optim": {"step": torch.tensor(float(iteration)), "m": torch.randn(4096, generator=g)},
        "rng": torch.Generator().manual_seed(owner + iteration).get_state(),
        "ints": torch.arange(1000, dtype=torch.int64) * (owner + 1),
        "half": torch.randn(333, generator=g).half(),
        "iteration": iteration,
        "owner": owner,
    }


def _init():
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist, dist.get_rank()


def _manager(root: str, **kw):
    from trainguard.checkpoint import CliqueReplication, LocalCheckpointManager

    kw.setdefault("replication", CliqueReplication(factor=2))
    kw.setdefault("timeout", 60)
    kw.setdefault("keep", 3)
    return LocalCheckpointManager(root, **kw)


def _save_phase(roots: list[str], events_dir: str) -> dict:
    import threading

    from trainguard import events

    events.configure(events_dir, rank=int(os.environ["RANK"]))
    dist, rank = _init()
    threads_before = sorted(t.name for t in threading.enumerate())
    try:
        with _manager(roots[rank]) as mgr:
            for it in ITERS:
                mgr.save(part_state(rank, it), it)
            mgr.wait()
        leftovers = {
            "threads": sorted(t.name for t in threading.enumerate()) != threads_before,
            "children": [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid()],
            "memfds": [
                fd
                for fd in os.listdir("/proc/self/fd")
                if "trainguard" in _readlink(f"/proc/self/fd/{fd}")
            ],
        }
    finally:
        dist.destroy_process_group()
    return leftovers


def _ppid(pid: str) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if fields[0] != "Z" else -1


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("saved")
    roots = [str(base / f"node{r // 2}-rank{r}") for r in range(WORLD)]
    results = run_ranks(
        _save_phase,
        WORLD,
        args=(roots, str(base / "events")),
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    for r in results:
        leftovers = r.get()
        assert leftovers == {"threads": False, "children": [], "memfds": []}, leftovers
    return base


def _copy(saved: Path, tmp_path: Path) -> list[str]:
    roots = []
    for r in range(WORLD):
        name = f"node{r // 2}-rank{r}"
        shutil.copytree(saved / name, tmp_path / name)
        roots.append(str(tmp_path / name))
    return roots


def _recover(roots: list[str], events_dir: str, steps: list[dict]) -> list[dict]:
    """For each step: optionally delete files (globs under this rank's root), then a fresh
    manager runs find_latest and load (of ``request``, default the latest) on every rank."""
    import torch

    from tests.checkpoint.conftest import assert_same
    from trainguard import events
    from trainguard.errors import CheckpointError

    events.configure(events_dir, rank=int(os.environ["RANK"]))
    dist, rank = _init()
    outs = []
    try:
        for step in steps:
            dist.barrier()
            for pattern in step.get("delete", ()):
                for f in Path(roots[rank]).glob(pattern):
                    f.unlink()
            dist.barrier()
            out: dict = {}
            outs.append(out)
            with _manager(roots[rank], **step.get("kw", {})) as mgr:
                try:
                    if step.get("find", True):
                        out["latest"] = mgr.find_latest()
                except CheckpointError as exc:
                    out["latest_error"] = (type(exc).__name__, str(exc))
                target = step.get("request") or out.get("latest")
                if target is None:
                    continue
                try:
                    state = mgr.load(target)
                except CheckpointError as exc:
                    out["load_error"] = (type(exc).__name__, str(exc))
                    continue
                if state is None:
                    out["loaded"] = None
                    continue
                it = state["iteration"]
                assert state["owner"] == rank
                assert_same(state, part_state(rank, it))
                out["loaded"] = it
                torch.set_rng_state(state["rng"])  # its own storage: accepted
            out["dirs"] = sorted(os.listdir(roots[rank]))
    finally:
        dist.destroy_process_group()
    return outs


def _run_steps(roots, tmp_path, steps: list[dict], world=WORLD) -> list[list[dict]]:
    """Per step, the outcomes of every rank: result[step][rank]."""
    results = run_ranks(
        _recover,
        world,
        args=(roots, str(tmp_path / "events"), steps),
        env=ENV,
        rank_env=on_node,
        timeout=150,
    )
    per_rank = [r.get() for r in results]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(steps))]


def _run_recover(roots, tmp_path, request=None, world=WORLD, **kw) -> list[dict]:
    return _run_steps(roots, tmp_path, [{"request": request, "kw": kw}], world)[0]


def _loads(tmp_path: Path) -> dict[int, dict]:
    return {
        e["rank"]: e for e in read_events(tmp_path / "events") if e["kind"] == "local_ckpt_load"
    }


def test_save_phase_wrote_every_part_twice_and_events(saved: Path) -> None:
    for r in range(WORLD):
        root = saved / f"node{r // 2}-rank{r}"
        its = sorted(os.listdir(root))
        assert its == [f"iter_{i:012d}" for i in ITERS]
        peer = (r + 2) % WORLD
        for it in its:
            names = sorted(os.listdir(root / it))
            assert names == sorted(
                [f"owner{r:05d}.h{r:05d}.safetensors", f"owner{peer:05d}.h{r:05d}.safetensors"]
            ), names
    kinds = {e["kind"] for e in read_events(saved / "events")}
    assert {"local_ckpt_save", "local_ckpt_replicate", "local_ckpt_durable"} <= kinds
    replicate = [e for e in read_events(saved / "events") if e["kind"] == "local_ckpt_replicate"]
    assert len(replicate) == WORLD * len(ITERS)
    assert all(e["bytes_sent"] > 1 << 19 and e["duration"] > 0 for e in replicate)


def test_lost_node_root_recovers_newest_from_peer(saved: Path, tmp_path: Path) -> None:
    roots = _copy(saved, tmp_path)
    shutil.rmtree(roots[1])  # rank 1's node is gone with everything on it
    out = _run_recover(roots, tmp_path)
    assert [o["latest"] for o in out] == [3] * WORLD
    assert [o["loaded"] for o in out] == [3] * WORLD  # bit-exact, checked on each rank
    loads = _loads(tmp_path)
    assert loads[1]["source"] == "peer" and loads[1]["copy"] == "rank 3"
    assert loads[1]["transfers"] == 1
    for r in (0, 2, 3):
        assert loads[r]["source"] == "file" and loads[r]["copy"].startswith("local "), loads[r]
    assert all(e["bytes"] > 1 << 19 for e in loads.values())


def test_both_copies_lost_falls_back_then_nothing(saved: Path, tmp_path: Path) -> None:
    roots = _copy(saved, tmp_path)
    for r in (1, 3):
        for f in Path(roots[r], "iter_000000000003").glob("owner00001.*"):
            f.unlink()
    first, second = _run_steps(
        roots,
        tmp_path,
        [{"request": 3, "find": False}, {"request": 2, "delete": ["iter_*/owner00001.*"]}],
    )
    assert [o["loaded"] for o in first] == [2] * WORLD  # load(3) fell back to 2
    fallback = [e for e in read_events(tmp_path / "events") if e["kind"] == "local_ckpt_fallback"]
    assert len(fallback) == WORLD and "owner(s) [1]" in fallback[0]["reason"]
    for o in first:  # the incomplete iteration 3 is gone: no later save meets its copies
        assert o["dirs"] == ["iter_000000000001", "iter_000000000002"]
    # then every copy of owner 1's parts is gone: nothing is recoverable
    assert [o["latest"] for o in second] == [None] * WORLD
    assert all(o["load_error"][0] == "CheckpointNotFoundError" for o in second), second
    assert "owner(s) [1]" in second[0]["load_error"][1]


def test_corrupt_copy_is_skipped_for_the_other(saved: Path, tmp_path: Path) -> None:
    from trainguard.checkpoint.format.read import read_header

    roots = _copy(saved, tmp_path)
    own = Path(roots[0], "iter_000000000003", "owner00000.h00000.safetensors")
    header = read_header(own)
    with open(own, "r+b") as f:  # flip one byte in the middle of the data
        f.seek(header.data_start + (header.file_size - header.data_start) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = _run_recover(roots, tmp_path)
    assert [o["loaded"] for o in out] == [3] * WORLD
    assert _loads(tmp_path)[0]["copy"] == "rank 2"


def test_world_shrinks_parts_of_missing_ranks_go_to_nobody(saved: Path, tmp_path: Path) -> None:
    roots = _copy(saved, tmp_path)
    out = _run_recover(roots[:2], tmp_path, world=2)
    assert [o["latest"] for o in out] == [3, 3] and [o["loaded"] for o in out] == [3, 3]
    changed = [
        e for e in read_events(tmp_path / "events") if e["kind"] == "local_ckpt_world_changed"
    ]
    assert changed and changed[0]["unloaded_owners"] == [2, 3]
    assert changed[0]["saved_world"] == 4 and changed[0]["world_size"] == 2


def test_replication_setting_change_is_explained(saved: Path, tmp_path: Path) -> None:
    from trainguard.checkpoint import CliqueReplication

    roots = _copy(saved, tmp_path)
    changed = {"replication": CliqueReplication(factor=1)}
    refused, allowed = _run_steps(
        roots,
        tmp_path,
        [{"kw": changed}, {"kw": {**changed, "allow_replication_change": True}}],
    )
    for o in refused:
        name, text = o["latest_error"]
        assert name == "CheckpointReplicationMismatchError"
        assert "factor=2, by host" in text and "factor=1" in text
        assert "allow_replication_change" in text
    assert [o["loaded"] for o in allowed] == [3] * WORLD


def _killed_mid_save(roots: list[str], flag: str) -> dict:
    from trainguard.errors import CheckpointError

    dist, rank = _init()
    out: dict = {}
    try:
        with _manager(roots[rank], timeout=6, on_error="raise") as mgr:
            mgr.save(part_state(rank, 1), 1)
            mgr.wait()
            Path(flag, f"saved1-{rank}").touch()
            if rank == 2:
                os.kill(mgr._writer.pid, signal.SIGSTOP)  # its part of 2 stays mid-write
            mgr.save(part_state(rank, 2), 2)
            if rank == 2:
                Path(flag, "dying").touch()
                time.sleep(60)  # the test kills this rank and its writer here
            try:
                mgr.wait()
                out["error"] = None
            except CheckpointError as exc:
                out["error"] = type(exc).__name__
    finally:
        dist.destroy_process_group()
    return out


def test_rank_killed_during_save_leaves_previous_recoverable(tmp_path: Path) -> None:
    roots = [str(tmp_path / f"rank{r}") for r in range(WORLD)]
    flag = tmp_path / "flags"
    flag.mkdir()
    with RankGroup(
        _killed_mid_save, WORLD, args=(roots, str(flag)), env=ENV, rank_env=on_node, timeout=150
    ) as g:
        g.start()
        g.wait_until(lambda: (flag / "dying").exists(), timeout=120)
        time.sleep(0.2)
        g.kill(2, whole_group=True)  # the rank and its writer process
        results = g.join()
    assert results[2].exitcode == -signal.SIGKILL
    for r in (0, 1, 3):
        assert results[r].get()["error"] == "CheckpointWriteError", results[r].get()
    replicated = Path(roots[0], "iter_000000000002", "owner00002.h00000.safetensors").exists()
    out = _run_recover(roots, tmp_path, keep=3)
    latest = out[0]["latest"]
    assert latest in (1, 2) and [o["latest"] for o in out] == [latest] * WORLD
    assert [o["loaded"] for o in out] == [latest] * WORLD
    if not replicated:  # rank 2's part of 2 exists nowhere: the previous iteration
        assert latest == 1
    if latest == 1:  # and the incomplete iteration 2 is removed everywhere
        assert all(not Path(root, "iter_000000000002").exists() for root in roots)


def _restart_job(roots: list[str], steps: int, fault_step: int | None, events_dir: str) -> dict:
    """Train the tiny model of tests/restart with a local checkpoint every 3 steps under the
    in-process restart wrapper. With ``fault_step``, rank 1 loses its whole local root and
    raises at that step of round 0; the next round resumes from find_latest + load."""
    import torch
    import torch.distributed as dist

    import trainguard.restart as tr
    from tests.restart import _jobs
    from trainguard import events

    events.configure(events_dir, rank=int(os.environ["RANK"]))
    resumed: list[tuple[int, int | None]] = []

    @tr.Wrapper(barrier_timeout=60, completion_timeout=60)
    def train(call: tr.CallWrapper) -> torch.Tensor:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        with _manager(roots[call.rank], keep=2) as mgr:
            it = mgr.find_latest()
            if it is None:
                w, start = torch.zeros(_jobs.DIM + 1, dtype=torch.float64), 0
            else:
                state = mgr.load(it)
                w, start = state["w"].clone(), state["step"] + 1
            resumed.append((call.round, it))
            for step in range(start, steps):
                if call.round == 0 and step == fault_step and call.rank == 1:
                    mgr.wait()  # iteration fault_step-1 is complete everywhere: then lose it here
                    shutil.rmtree(roots[call.rank])
                    raise ValueError(f"injected fault at step {step}")
                g = _jobs._grad(w, *_jobs.batch(step, call.rank, call.world_size))
                dist.all_reduce(g)
                w = w - 0.1 * g / call.world_size
                if step % 3 == 2:
                    mgr.save({"w": w, "step": step}, step)
            mgr.wait()
        dist.destroy_process_group()
        return w

    w = train()
    return {"w": w.numpy().tobytes().hex(), "resumed": resumed}


def test_resume_after_in_process_restart_is_bit_identical(tmp_path) -> None:
    """A fault mid-training, the wrapper restarts, find_latest + load resume (rank 1's part
    from its peer, its own root being gone), and the run ends bit-identical to a fault-free
    run of the same code."""
    steps, fault_step = 16, 12
    out = {}
    for name, fault in (("clean", None), ("faulted", fault_step)):
        roots = [str(tmp_path / name / f"node{r}") for r in range(WORLD)]
        results = run_ranks(
            _restart_job,
            WORLD,
            args=(roots, steps, fault, str(tmp_path / name / "events")),
            env=ENV,
            rank_env=on_node,
            timeout=150,
        )
        out[name] = [r.get() for r in results]
    clean, faulted = out["clean"], out["faulted"]
    assert len({o["w"] for o in clean}) == 1  # every rank holds the same weights
    assert [o["w"] for o in faulted] == [o["w"] for o in clean]  # bit-identical
    assert all(o["resumed"] == [(0, None)] for o in clean)
    assert all(o["resumed"] == [(0, None), (1, fault_step - 1)] for o in faulted)
    loads = [
        e
        for e in read_events(tmp_path / "faulted" / "events")
        if e["kind"] == "local_ckpt_load" and e["rank"] == 1
    ]
    assert len(loads) == 1 and loads[0]["source"] == "peer"  # fetched from a peer
