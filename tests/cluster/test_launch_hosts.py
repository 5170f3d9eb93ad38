"""``trainguard launch`` with the Wrapper on emulated hosts: deaths, replacements, partitions.

3 hosts x 2 workers, ``FillGaps`` + ``MaxActiveWorldSize(4)`` (2 spares), node heartbeat timeout
3 s. Every scenario checks every active rank's result, the agents' exit codes and that no process
is left (the ``cluster`` fixture).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster
from tests.cluster._job import RDZV_PORT, HostJob, records
from tests.launch._agents import alive

pytestmark = pytest.mark.timeout(150)

HB = ["--tg-heartbeat-interval=0.5", "--tg-heartbeat-timeout=3", "--tg-exit-barrier-timeout=20"]


def _job(c: Cluster, tmp_path: Path, steps: int = 60, **kw: object) -> tuple[HostJob, Path]:
    out = tmp_path / "out"
    out.mkdir()
    worker = ["wrapper", str(out), "--active=4", f"--steps={steps}", "--step=0.1"]
    job = HostJob(c, tmp_path, nproc=2, worker=worker, extra=[*HB, "--max-restarts=0"], **kw)  # type: ignore[arg-type]
    return job, out


def _round(out: Path, n: int, step: int = 3, world: int = 4) -> bool:
    """Every active rank of round ``n`` reached ``step`` in a world of ``world``."""
    got = {
        s["rank"]
        for s in records(out / "steps.jsonl")
        if s["round"] >= n and s["step"] >= step and s["world"] == world
    }
    return len(got) >= world


def _results(out: Path) -> list[str]:
    return sorted(p.read_text() for p in out.glob("result-*"))


def _starts(out: Path) -> list[dict[str, object]]:
    return records(out / "starts.jsonl")


def test_partition_and_heal_of_a_host_that_is_not_the_store_s(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """h2 (active ranks 2 and 3) cut off for 12 s: h3's spares take its ranks, h2 fences
    itself, and after the heal it rejoins as a new node: no whole-job restart, every agent
    ends with 0, every rank's result is right."""
    c = cluster(3)
    job, out = _job(c, tmp_path, steps=100)
    job.start()
    job.wait_for(lambda: _round(out, 0), what="round 0 running on 4 ranks", timeout=90)
    h2 = c.hosts[1]
    before = {s["pid"] for s in _starts(out) if s["rank"] in (2, 3)}
    cut_at = time.monotonic()
    c.cut(h2)
    job.wait_for(lambda: _round(out, 1), what="the others training again without h2", timeout=40)
    again = time.monotonic() - cut_at
    # h2 fenced itself: its workers are gone while it is still cut off
    job.wait_for(lambda: not any(alive(p) for p in before), what="h2's workers stopped", timeout=10)
    time.sleep(max(0.0, 12 - (time.monotonic() - cut_at)))
    c.heal(h2)
    healed = time.monotonic()
    job.wait_for(
        lambda: len([s for s in _starts(out) if s["incarnation"] not in ("0", None)]) >= 2,
        what="h2's workers started again as newcomers",
        timeout=40,
    )
    back = time.monotonic() - healed
    codes = job.wait(timeout=100)
    out_text = job.output()
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, out_text
    assert {s["generation"] for s in _starts(out)} == {"0"}, "the job was restarted"
    assert _results(out) == ["4", "4", "4", "4", "spare", "spare"], out_text
    assert "whole-job restart" not in out_text
    print(f"training again {again:.1f} s after the cut; h2 back {back:.1f} s after the heal")


def _worker_pids(out: Path, ranks: tuple[int, ...]) -> set[int]:
    return {int(s["pid"]) for s in _starts(out) if s["rank"] in ranks}  # type: ignore[call-overload]


def test_a_worker_killed_on_a_host_is_respawned_and_the_job_ends_right(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(3)
    job, out = _job(c, tmp_path, steps=40)
    job.start()
    job.wait_for(lambda: _round(out, 0), what="round 0 running on 4 ranks", timeout=90)
    (victim,) = _worker_pids(out, (2,))
    os.kill(victim, signal.SIGKILL)
    job.wait_for(
        lambda: any(s["rank"] == 2 and s["incarnation"] == "1" for s in _starts(out)),
        what="rank 2 respawned on h2",
        timeout=30,
    )
    codes = job.wait(timeout=100)
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, job.output()
    assert {s["generation"] for s in _starts(out)} == {"0"}
    assert _results(out) == ["4", "4", "4", "4", "spare", "spare"], job.output()


def test_a_dead_host_is_replaced_by_a_new_host_while_the_others_train(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """Every process of h2 SIGKILLed: h1 and h3 go on (h3's spares take ranks 2 and 3); a new
    host h4 started for it takes its place and its workers join as newcomers.

    The job is held until h4's workers started: its last round's 7 s of steps were shorter
    than h4's agent took to start on a loaded machine (twice in CI: the job ended first and
    h4 had no place left to take)."""
    c = cluster(4)
    job, out = _job(c, tmp_path, steps=70, hosts=c.hosts[:3])
    (out / "hold").touch()  # every round goes on until h4's workers started
    job.start()
    job.wait_for(lambda: _round(out, 0), what="round 0 running on 4 ranks", timeout=90)
    c.kill_host(c.hosts[1])
    job.wait_for(lambda: _round(out, 1), what="the others training again without h2", timeout=40)
    job.add(c.hosts[3])
    job.wait_for(
        lambda: len([s for s in _starts(out) if s["incarnation"] not in ("0", None)]) >= 2,
        what="h4's workers started in h2's place",
        timeout=60,
    )
    (out / "hold").unlink()
    codes = job.wait(["h1", "h3", "h4"], timeout=100)
    assert codes == {"h1": 0, "h3": 0, "h4": 0}, job.output()
    assert job.agents["h2"].poll() == -signal.SIGKILL
    assert {s["generation"] for s in _starts(out)} == {"0"}
    assert _results(out) == ["4", "4", "4", "4", "spare", "spare"], job.output()


def test_partition_of_the_store_s_host_the_store_s_side_goes_on_the_other_side_fences(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """h1 hosts the store (the first agent) and is cut off for 12 s: h1 is the job and goes on
    with its own ranks; h2 and h3 fence themselves before h1 counts them out (no step of
    theirs after h1 trains alone: never two sides at once), then rejoin after the heal."""
    c = cluster(3)
    job, out = _job(c, tmp_path, steps=250)
    job.start()
    job.wait_for(lambda: _round(out, 0), what="round 0 running on 4 ranks", timeout=90)
    others = _worker_pids(out, (2, 3, 4, 5))
    cut_at = time.time()
    c.cut(c.hosts[0])
    job.wait_for(lambda: _round(out, 1, world=2), what="h1 training alone with 2 ranks", timeout=40)
    alone = min(
        s["time"] for s in records(out / "steps.jsonl") if s["round"] >= 1 and s["world"] == 2
    )
    time.sleep(max(0.0, 12 - (time.time() - cut_at)))
    c.heal(c.hosts[0])
    job.wait_for(lambda: _round(out, 2), what="the job back at 4 active ranks", timeout=60)
    codes = job.wait(timeout=110)
    steps = records(out / "steps.jsonl")
    late = [s for s in steps if s["pid"] in others and s["time"] >= alone]
    assert late == [], "h2 or h3 trained while h1 trained alone"
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, job.output()
    assert {s["generation"] for s in _starts(out)} == {"0"}
    rejoined = [s for s in _starts(out) if s["incarnation"] not in ("0", None)]
    assert len(rejoined) == 4, job.output()
    assert _results(out) == ["4", "4", "4", "4", "spare", "spare"], job.output()
    print(f"h1 alone {alone - cut_at:.1f} s after the cut; results {_results(out)}")


def test_a_job_on_several_hosts_without_a_job_secret_does_not_start(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(2)
    out = tmp_path / "out"
    out.mkdir()
    job = HostJob(
        c, tmp_path, nproc=1, worker=["run", str(out)], env={"TRAINGUARD_JOB_SECRET": "-"}
    )
    job.start()
    codes = job.wait(timeout=60)
    assert codes == {"h1": 2, "h2": 2}, job.output()
    assert job.output().count("TRAINGUARD_JOB_SECRET to the same random value") == 2
    assert not (out / "starts.jsonl").exists()


STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
print("store up", flush=True)
while True:
    time.sleep(3600)
"""


def test_with_an_external_store_the_job_goes_on_without_the_first_host(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """The rendezvous and coordination store on a fourth host (``--tg-store``): h1 (active ranks
    0 and 1, the first store process with the rounds' stores) cut off; h2 and h3 go on with 4
    ranks (h3's spares take 0 and 1) on the standby's round stores (h2); h1 rejoins."""
    c = cluster(4)
    h4 = c.hosts[3]
    c.start(h4, [sys.executable, "-c", STORE, str(RDZV_PORT)], log=tmp_path / "store.log")
    out = tmp_path / "out"
    out.mkdir()
    worker = ["wrapper", str(out), "--active=4", "--steps=150", "--step=0.1"]
    extra = [*HB, "--max-restarts=0", f"--tg-store={h4.name}:{RDZV_PORT}"]
    job = HostJob(c, tmp_path, nproc=2, worker=worker, extra=extra, hosts=c.hosts[:3], rdzv_host=h4)
    job.start()
    job.wait_for(lambda: _round(out, 0), what="round 0 running on 4 ranks", timeout=90)
    first = _worker_pids(out, (0, 1))
    cut_at = time.time()
    c.cut(c.hosts[0])
    job.wait_for(lambda: _round(out, 1), what="h2 and h3 training on 4 ranks", timeout=40)
    again = min(s["time"] for s in records(out / "steps.jsonl") if s["round"] >= 1)
    time.sleep(max(0.0, 12 - (time.time() - cut_at)))
    c.heal(c.hosts[0])
    codes = job.wait(timeout=110)
    late = [s for s in records(out / "steps.jsonl") if s["pid"] in first and s["time"] >= again]
    assert late == [], "h1 trained while the others trained without it"
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, job.output()
    assert {s["generation"] for s in _starts(out)} == {"0"}
    assert _results(out) == ["4", "4", "4", "4", "spare", "spare"], job.output()
    print(f"training again {again - cut_at:.1f} s after the cut")
