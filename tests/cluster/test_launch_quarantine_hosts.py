"""``trainguard launch --tg-quarantine-after 2`` on emulated hosts: 3 hosts x 1 worker, the
Wrapper's ``FillGaps`` + ``MaxActiveWorldSize(2)`` (one spare, on h3). The worker on h2 raises
at step 2 of each round it is active in (a flaky host): after its second fault h2 is taken
out, h3's spare takes its rank, the job ends at full active size and the quarantine file names
h2; its agent respawns no worker there, probes it and, once its probe passes, lets it back
as a spare."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster
from tests.cluster._job import HostJob, records
from trainguard.events import read_events

pytestmark = pytest.mark.timeout(170)

FLAGS = [
    "--tg-heartbeat-interval=0.5",
    "--tg-heartbeat-timeout=5",
    "--tg-exit-barrier-timeout=20",
    "--max-restarts=0",
    "--tg-quarantine-after=2",
]


def _job(
    c: Cluster, tmp_path: Path, flags: list[str], worker: list[str]
) -> tuple[HostJob, Path, Path]:
    out, events = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    cmd = ["wrapper", str(out), "--active=2", "--step=0.1", "--raise-host=h2", *worker]
    env = {"TRAINGUARD_EVENTS_DIR": str(events), "TRAINGUARD_HOST_NAME": "-"}
    job = HostJob(c, tmp_path, nproc=1, worker=cmd, extra=[*FLAGS, *flags], env=env)
    return job, out, events


def _kinds(events: Path, kind: str) -> list[dict[str, object]]:
    return [e for e in read_events(events) if e["kind"] == kind] if events.exists() else []


def _results(out: Path) -> dict[int, str]:
    return {int(p.name.split("-")[1]): p.read_text() for p in out.glob("result-*")}


def test_a_flaky_host_is_taken_out_after_two_faults_and_the_job_ends_at_full_size(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(3)
    exclude = tmp_path / "exclude-hosts"
    job, out, events = _job(c, tmp_path, [f"--tg-quarantine-file={exclude}"], ["--steps=25"])
    (out / "hold").touch()  # the last round goes on until the test removed it
    job.start()
    job.wait_for(lambda: _kinds(events, "launch_quarantined"), what="h2 quarantined", timeout=100)
    # h2's worker dies while its host is out: its agent does not respawn it
    (victim,) = {s["pid"] for s in records(out / "starts.jsonl") if s["rank"] == 1}
    os.kill(int(victim), signal.SIGKILL)
    job.wait_for(lambda: _kinds(events, "launch_worker_held"), what="h2's death held", timeout=30)
    time.sleep(1.0)
    (out / "hold").unlink()
    codes = job.wait(timeout=100)
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, job.output()
    assert not _kinds(events, "launch_respawned"), "a worker was respawned on a host that is out"
    assert len(records(out / "starts.jsonl")) == 3
    # h1's rank 0 and h3's spare (in h2's rank number) finished at world 2
    assert _results(out) == {0: "2", 2: "2"}, job.output()
    steps = records(out / "steps.jsonl")
    # round 2 (after the second fault) runs without h2; its spare's death may start round 3
    assert min(s["round"] for s in steps if s["initial"] == 2) == 2
    for n in range(2, max(s["round"] for s in steps) + 1):
        ran = [s for s in steps if s["round"] == n]
        assert {(s["rank"], s["initial"]) for s in ran} == {(0, 0), (1, 2)}, n
        assert all(s["sum"] == 2 for s in ran)
    assert max(s["step"] for s in steps) >= 24  # the last round ran every step
    h2_steps = [s for s in steps if s["initial"] == 1]
    assert {s["round"] for s in h2_steps} == {0, 1}, "h2 never active after it was taken out"
    faults = [(e["fault_host"], e["counted"]) for e in _kinds(events, "fault_attributed")]
    assert faults[:2] == [("h2", True), ("h2", True)], faults
    assert all(f == ("h2", False) for f in faults[2:]), faults  # its spare's death: h2, out
    assert [e["quarantined_host"] for e in _kinds(events, "host_quarantined")] == ["h2"]
    taken = _kinds(events, "launch_quarantined")
    assert [(e["quarantined_host"], e["host"]) for e in taken] == [("h2", "h2")], taken
    assert exclude.read_text() == "h2\n"
    assert {s["generation"] for s in records(out / "starts.jsonl")} == {"0"}


def test_a_host_is_kept_out_while_its_probe_hangs_and_back_as_a_spare_once_it_passes(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    """h2 raises (and its probe, --tg-health-check, hangs) while a marker file exists: it is
    taken out, each probe round fails at the 10 s bound; the marker removed, two passes in a
    row, and at the next round (a death on h1) h2 is readmitted as a spare."""
    c = cluster(3)
    marker, hold = tmp_path / "broken", tmp_path / "out" / "hold"
    marker.touch()
    flags = [
        "--tg-health-interval=0.5",
        "--tg-readmit-after=2",
        "--tg-probe-timeout=10",
        f"--tg-health-check=test ! -e {marker} || sleep 60",
    ]
    job, out, events = _job(c, tmp_path, flags, ["--steps=10", f"--raise-while={marker}"])
    hold.touch()
    job.start()
    job.wait_for(lambda: _kinds(events, "launch_quarantined"), what="h2 quarantined", timeout=100)

    def failed_rounds() -> list[dict[str, object]]:
        failed = [e for e in _kinds(events, "launch_probe") if not e["passed"]]
        return failed if len(failed) >= 2 else []

    failed = job.wait_for(failed_rounds, what="two failed probe rounds on h2", timeout=60)[:2]
    assert all("did not return within 10 s" in str(e["result"]) for e in failed), failed
    gap = float(failed[1]["time"]) - float(failed[0]["time"])  # type: ignore[arg-type]
    assert gap < 10 + 0.5 + 5, f"a hung probe round took {gap:.1f} s (bound 10 s)"
    assert not _kinds(events, "launch_readmitted")
    marker.unlink()
    job.wait_for(
        lambda: any(e["passes"] == 2 for e in _kinds(events, "launch_probe")),
        what="two passing probe rounds in a row",
        timeout=60,
    )
    assert not _kinds(events, "host_readmitted"), "readmitted before a round was laid out"
    (victim,) = {s["pid"] for s in records(out / "starts.jsonl") if s["rank"] == 0}
    os.kill(int(victim), signal.SIGKILL)  # a fault elsewhere: the next round readmits h2
    job.wait_for(lambda: _kinds(events, "launch_readmitted"), what="h2 back", timeout=60)
    assert [e["quarantined_host"] for e in _kinds(events, "host_readmitted")] == ["h2"]
    time.sleep(1.0)
    hold.unlink()
    codes = job.wait(timeout=80)
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, job.output()
    results = _results(out)
    assert sorted(results.values()).count("2") == 2, results  # the job ended at world 2
