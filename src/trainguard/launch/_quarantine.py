"""A node's agent under a quarantine policy (``--tg-quarantine-after N``): it learns that its
host was taken out, stops respawning its workers, probes the host and lets it back.

The judgement is the Wrapper's (:class:`~trainguard.restart.Quarantine`): whoever lays a
round out attributes the fault that ended the round before and takes a host with ``after``
faults within the window out; its ranks wait as spares and (``FillGaps``) idle spares
elsewhere take their numbers. This module is the agent's side of it:

1. :meth:`NodeQuarantine.env` gives the workers the policy (``TRAINGUARD_QUARANTINE``: after,
   window, file, probe timeout, readmit "never" or not, and a node-local directory made for
   this agent). Their Wrapper uses it when it has no ``quarantine=`` of its own.
2. Each rank, on entering each round, writes whether its host is out to ``node_dir/state``
   (:meth:`~trainguard.restart.Quarantine.tell_node`). :meth:`NodeQuarantine.poll` (each
   monitor tick, one ``stat``) reads it when it changed: the agent emits
   ``launch_quarantined`` / ``launch_readmitted``. The node stays in the rendezvous (its
   heartbeat goes on): it is quarantined, not lost.
3. While its host is out, a worker that dies is not respawned (:attr:`NodeQuarantine.out`:
   the agent tells the sidecar the rank is not coming back, so nobody waits for it).
4. A prober thread runs the probes every ``--tg-health-interval`` seconds: free space on
   ``/dev/shm``; ``--tg-health-check CMD``; in as many processes as the node has workers, a
   small matrix product on each one's device (:class:`~trainguard.restart.probes.MatmulProbe`)
   and a gloo all-reduce among them with a known sum (:mod:`trainguard.launch._probecoll`).
   Each is a process killed at ``--tg-probe-timeout`` (a hung probe failed, and leaves nothing
   behind). After ``--tg-readmit-after`` passes in a row it writes "ok" to
   ``node_dir/verdict``; a failure resets the count and writes why. The ranks' own probe at
   their next barrier is that verdict, and the round laid out then lets the host back as a
   spare (``--tg-readmit never``: no probes, it stays out).

Limits: the host comes back at the next round (a fault elsewhere, or a newcomer's admission);
a worker that died while its host was out stays done for the rest of the generation; a node
whose workers all died while out has no worker left to learn of a round, and ends as finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.launch.options import LaunchOptions

__all__ = ["NodeQuarantine", "Probe"]

logger = logging.getLogger(__name__)

Emit = Callable[..., None]

_MATMUL = "from trainguard.restart.probes import MatmulProbe; MatmulProbe(64)(); print('ok')"


class Probe:
    """One probe run as a process (``argv``), passed when it exits 0 within the timeout."""

    def __init__(self, name: str, argv: list[str], *, shell: bool = False) -> None:
        self.name, self.argv, self.shell = name, argv, shell

    def run(self, timeout: float, cwd: str | None = None) -> str | None:
        """None when it passed, else why it failed (a hang is killed at ``timeout``)."""
        try:
            proc = subprocess.Popen(
                self.argv[0] if self.shell else self.argv,
                shell=self.shell,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a hung probe's children die with it
                cwd=cwd,
            )
        except OSError as exc:
            return f"{self.name} could not start: {exc}"
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            return f"{self.name} did not return within {timeout:g} s"
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            return f"{self.name} failed (exit status {proc.returncode}) {tail[0][:200]}".rstrip()
        return None

    def __repr__(self) -> str:
        return f"Probe({self.name!r})"


def _killpg(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def builtin_probes(options: LaunchOptions, nproc: int) -> list[Probe]:
    """The node's probes, cheap ones first (the first failure ends a round): free space on
    ``/dev/shm``, the user's command, matmul and the collective of ``nproc`` processes."""
    py = sys.executable
    probes = [Probe("free space on /dev/shm", [py, "-c", _FREE])]
    if options.health_check:
        name = f"--tg-health-check {options.health_check!r}"
        probes.append(Probe(name, [options.health_check], shell=True))
    module = [py, "-m", "trainguard.launch._probecoll", str(nproc)]
    probes.append(Probe(f"matmul and gloo all-reduce in {nproc} processes", module))
    return probes


_FREE = (
    "import shutil, sys; free = shutil.disk_usage('/dev/shm').free; "
    "sys.exit(0 if free >= 64 << 20 else f'{free} bytes free on /dev/shm')"
)


class NodeQuarantine:
    """This agent's side of the quarantine (see the module docstring); inert when
    ``options.quarantine_after`` is 0. From the monitor thread: :meth:`env`, :meth:`poll`,
    :meth:`close`; the prober is a thread of its own."""

    def __init__(self, options: LaunchOptions, emit: Emit, host: str, nproc: int) -> None:
        self.options, self.emit, self.host, self.nproc = options, emit, host, nproc
        self.on = options.quarantine_after > 0
        self.dir = Path(tempfile.mkdtemp(prefix="tg-quarantine-")) if self.on else None
        self.out = False  # this host is quarantined (its workers are not respawned)
        self.why = ""
        self._stamp: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """What the workers need: the policy (none when off)."""
        if self.dir is None:
            return {}
        o = self.options
        spec = {
            "after": o.quarantine_after,
            "window": o.quarantine_window,
            "readmit": None if o.readmit == "never" else o.readmit_after,
            "probe_timeout": o.probe_timeout,
            "file": o.quarantine_file,
            "node_dir": str(self.dir),
        }
        return {"TRAINGUARD_QUARANTINE": json.dumps(spec)}

    def poll(self) -> None:
        """Each tick: read what the workers last said (when the file changed)."""
        if self.dir is None:
            return
        try:
            st = (self.dir / "state").stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            state: dict[str, Any] = json.loads((self.dir / "state").read_text())
        except (OSError, ValueError):
            return
        out = bool(state.get("out"))
        if out and not self.out:
            self._taken_out(str(state.get("why", "")))
        elif self.out and not out:
            self._back()

    def _taken_out(self, why: str) -> None:
        self.out, self.why = True, why
        logger.warning("host %s quarantined (%s): no respawns on it, probing it", self.host, why)
        self.emit("launch_quarantined", quarantined_host=self.host, why=why)
        self._write_verdict("not probed yet")
        if self.options.readmit == "never":
            return
        self._stop.clear()
        self._prober = threading.Thread(
            target=self._probe_loop, name="trainguard-quarantine-probes", daemon=True
        )
        self._prober.start()

    def _back(self) -> None:
        self.out = False
        logger.warning("host %s readmitted as a spare", self.host)
        self.emit("launch_readmitted", quarantined_host=self.host)
        self._end_prober()
        self._write_verdict("not probed yet")

    def _probe_loop(self) -> None:
        probes = builtin_probes(self.options, self.nproc)
        passes = 0
        while not self._stop.wait(self.options.health_interval):
            failure = None
            for probe in probes:
                failure = probe.run(self.options.probe_timeout, cwd=str(self.dir))
                if failure is not None or self._stop.is_set():
                    break
            if self._stop.is_set():
                return
            passes = 0 if failure is not None else passes + 1
            self.emit(
                "launch_probe",
                quarantined_host=self.host,
                passed=failure is None,
                result=failure or "ok",
                passes=passes,
            )
            if failure is not None:
                logger.warning("host %s failed a probe: %s", self.host, failure)
            ready = passes >= self.options.readmit_after
            self._write_verdict(
                "ok" if ready else failure or f"{passes} of {self.options.readmit_after} passes"
            )

    def _write_verdict(self, text: str) -> None:
        if self.dir is None:
            return
        tmp = self.dir / ".verdict"
        try:
            tmp.write_text(text)
            os.replace(tmp, self.dir / "verdict")
        except OSError as exc:  # the directory was removed: the agent is closing
            logger.debug("cannot write the verdict: %s", exc)

    def _end_prober(self) -> None:
        self._stop.set()
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.join(self.options.probe_timeout + 5)

    def close(self) -> None:
        """Stop the prober, remove the node directory (idempotent)."""
        self._end_prober()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
