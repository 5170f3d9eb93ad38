"""``trainguard demo --launch`` end to end: 2 agents x 2 workers under ``trainguard launch``, a
worker SIGKILLed (respawned, rejoins), a whole node SIGKILLed (agent and workers), a
replacement node admitted, and the result still bit-identical to the fault-free run.

Respawned workers start slow here (a ``sitecustomize`` that sleeps in every process of an
incarnation > 0, as a loaded node would): the node must not go before the respawned worker
waits to be admitted, or the job is left with one live rank (a CI failure the demo had).

The demo runs in a session of its own with a marker in its environment (every process of the
job inherits it); whatever outlives the command, or the hard limit, is killed by group and pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.launch._agents import kill_all, leftovers

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 150.0  # seconds: the whole demo (about 70 s here)
SLOW_START_S = 4.0  # longer than the job takes from the worker's kill to the node's step

_SLOW_START = f"""\
import os, time
if int(os.environ.get("TRAINGUARD_INCARNATION") or 0) > 0:
    time.sleep({SLOW_START_S})
"""


def test_launch_demo_survives_a_worker_and_a_node_bit_identically(tmp_path: Path) -> None:
    out = tmp_path / "run"
    marker = f"tg-launch-demo-{uuid.uuid4().hex}"
    env = dict(os.environ, TRAINGUARD_JOB_ID=marker)
    src = str(ROOT / "src")
    slow = tmp_path / "slow-start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(_SLOW_START)
    paths = (src, str(slow), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, "-m", "trainguard", "demo", "--launch", "--steps", "150"]
    cmd += ["--out", str(out), "--timeout", str(LIMIT - 20)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        text = proc.communicate(timeout=LIMIT)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text = proc.communicate()[0].decode(errors="replace")
        raise AssertionError(f"the demo ran past {LIMIT:.0f} s\n{text}") from None
    finally:
        deadline = time.monotonic() + 15  # store processes exit once the job's ranks left
        while leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_all(marker) + kill_all(str(out))
    assert not left, f"processes outlived the demo: {left}\n{text}"
    assert proc.returncode == 0, text
    assert "bit-identical: yes" in text
    # the worker: killed, respawned by its agent with a new incarnation, admitted again
    assert re.search(r"! SIGKILL worker process 1 \(rank 1, pid \d+\)", text), text
    assert re.search(r"> process 1 respawned by its agent: pid \d+, incarnation [1-9]", text)
    assert re.search(r"> process 1 \(pid \d+, incarnation [1-9]\) admitted at round \d+", text)
    # the node: its agent and workers killed, declared lost by the other agent; only once
    # the respawned worker waits to be admitted (it then takes the lost node's rank)
    lost = re.search(r"! node 1 lost: SIGKILL its agent \(pid \d+\)", text)
    assert lost, text
    waits = re.search(r"process 1 \(pid \d+, incarnation [1-9]\) waits to be admitted", text)
    assert waits and waits.start() < lost.start(), text
    assert "node 1 declared lost by the agent of node 0" in text
    # the replacement: same rendezvous id, its workers admitted as newcomers
    assert "+ replacement node started" in text
    for process in (2, 3):
        assert re.search(
            rf"> replacement node 1: worker process {process} started, pid \d+, incarnation [1-9]",
            text,
        ), text
        assert re.search(
            rf"> spare process {process} \(pid \d+, incarnation [1-9]\) admitted at round", text
        ), text
    assert (out / "report.json").exists() and (out / "timeline.png").exists()


def test_file_channels_are_read_line_by_line_as_they_grow(tmp_path: Path) -> None:
    from trainguard.demo._channel import FileChannel, JsonlTail

    tail = JsonlTail(tmp_path / "channels", "process-*.jsonl")
    assert tail.poll() == []  # no folder yet
    one = FileChannel(tmp_path / "channels" / "process-0-1.jsonl")
    one.send("hello", 0, 1, 0, 0, 9)
    with open(tmp_path / "channels" / "process-1-2.jsonl", "ab") as f:
        f.write(b'["step", 4, 0.5')  # a message whose writer was killed mid-line (so far)
    assert tail.poll() == [["hello", 0, 1, 0, 0, 9]]
    with open(tmp_path / "channels" / "process-1-2.jsonl", "ab") as f:
        f.write(b", 0, 2, 1.0]\n")
    one.send("done", 0, 0, "ab", 1, 2.0)
    one.close()
    one.send("ignored after close")
    assert tail.poll() == [["done", 0, 0, "ab", 1, 2.0], ["step", 4, 0.5, 0, 2, 1.0]]
    assert tail.poll() == []
