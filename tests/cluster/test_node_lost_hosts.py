"""A node declared lost by an agent whose own workers are not in a wrapped call yet (issue 40,
item 6), on emulated hosts under ``trainguard launch``.

3 hosts x 2 workers (``FillGaps`` + ``MaxActiveWorldSize(4)``), node heartbeat timeout 3 s. h2
is killed and a replacement h4 takes its place; 0.5 s after h4's agent started its workers
(they sleep 8 s before they import anything, as a slow import of torch would) h3 is killed.
h4's agent, next on the ring, declares h3 lost while none of its workers has connected to it:
the death notices of h3's ranks must still be written, so that h1's survivors train again.
Before the fix the notices were dropped (``no wrapped call runs here``) and the survivors
waited at their barrier until it timed out.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster
from tests.cluster._job import HostJob, records

pytestmark = pytest.mark.timeout(240)

HB = ["--tg-heartbeat-interval=0.5", "--tg-heartbeat-timeout=3", "--tg-exit-barrier-timeout=20"]
DELAY = 8.0  # seconds a replacement's worker sleeps before it imports torch and the Wrapper


def _steps(out: Path) -> list[dict[str, object]]:
    return records(out / "steps.jsonl")


def _trained(out: Path, ranks: set[int], after: int, step: int = 3) -> list[int]:
    """The rounds past ``after`` in which every initial rank of ``ranks`` reached ``step``."""
    done: dict[int, set[int]] = {}
    for s in _steps(out):
        if s["round"] > after and s["step"] >= step:  # type: ignore[operator]
            done.setdefault(int(s["round"]), set()).add(int(s["initial"]))  # type: ignore[call-overload]
    return sorted(n for n, got in done.items() if ranks <= got)


def test_a_node_lost_while_the_declaring_agent_s_workers_start_is_counted_out(
    cluster: Callable[[int], Cluster], tmp_path: Path
) -> None:
    c = cluster(4)
    h1, h2, h3, h4 = c.hosts
    out = tmp_path / "out"
    out.mkdir()
    (out / "hold").touch()  # every round goes on until the end of the test's faults
    worker = ["wrapper", str(out), "--active=4", "--steps=20", "--step=0.1"]
    worker.append(f"--newcomer-delay={DELAY:g}")
    extra = [*HB, "--max-restarts=0"]
    job = HostJob(c, tmp_path, nproc=2, worker=worker, extra=extra, hosts=[h1, h2, h3], timeout=220)
    job.start()
    job.wait_for(lambda: _trained(out, {0, 1, 2, 3}, -1), what="round 0 on 4 ranks", timeout=90)
    c.kill_host(h2)
    (without_h2, *_) = job.wait_for(
        lambda: _trained(out, {0, 1, 4, 5}, 0), what="h1 and h3 training without h2", timeout=40
    )
    job.add(h4)

    def newcomers() -> list[dict[str, object]]:
        return [s for s in records(out / "starts.jsonl") if s["incarnation"] not in ("0", None)]

    job.wait_for(lambda: len(newcomers()) >= 2, what="h4's workers started", timeout=40)
    time.sleep(0.5)
    c.kill_host(h3)
    killed, killed_wall = time.monotonic(), time.time()
    # h4 writes the notices once a worker of its own connects: after its 8 s sleep and its
    # imports, which can take half a minute on a loaded machine
    pids = {s["pid"] for s in newcomers()}

    def connected() -> list[float]:
        return [r["time"] for r in records(out / "ready.jsonl") if r["pid"] in pids]

    job.wait_for(connected, what="h4's workers past their imports", timeout=100)
    ready = time.monotonic()
    # then h1's ranks train again (with h4's newcomers or without them), well within the
    # barrier timeout (60 s from h3's loss) that they ran into before the fix
    (again, *_) = job.wait_for(
        lambda: _trained(out, {0, 1}, without_h2),
        what="h1's ranks training again after h3's loss",
        timeout=30,
    )
    took, after_ready = time.monotonic() - killed, time.monotonic() - ready
    (out / "hold").unlink()
    h4_log = (tmp_path / "agent-h4.log").read_text()
    assert "node 2 (ranks [4, 5]) is lost" in h4_log, job.output()
    codes = job.wait(["h1", "h4"], timeout=100)
    assert codes == {"h1": 0, "h4": 0}, job.output()
    assert job.agents["h3"].poll() == -signal.SIGKILL
    assert {s["generation"] for s in records(out / "starts.jsonl")} == {"0"}, "job restarted"
    # h4 declared it (>= 2.5 s after the kill: its last beat, then the 3 s timeout) before
    # any of its workers was in a wrapped call (they finish importing only after that)
    imported = connected()
    assert len(imported) == 2 and min(imported) > killed_wall + 3.0, (imported, killed_wall)
    print(
        f"h1's ranks trained again in round {again}, {took:.1f} s after h3 was killed, "
        f"{after_ready:.1f} s after h4's workers were past their imports"
    )
