"""The sidecar: one small process per rank that outlives its training process.

Started by the wrapper with ``python -m trainguard.restart._sidecar CONFIG_JSON`` (a fresh
interpreter: it does not import the user's ``__main__`` and shares nothing with a crashed
training process). Protocol:

1. It connects to the coordination store and prints one JSON handshake line on stdout.
2. The training process writes JSON lines on the sidecar's stdin: ``{"round": n, "roster":
   [...]}`` after each barrier, ``{"hb": 1, "in_fn": bool, "stall": s}`` from its watchdog
   thread every ``interval`` seconds, ``{"bye": 1}`` when the wrapped call has left the job.
3. It waits in ``select`` on a pidfd of the training process and on that pipe: the process's
   death wakes it at once (no timer). It then writes the death notice: the round's outcome
   (a fault, so the others abort) and the dead rank's departure at the next barrier
   (:meth:`Session.depart`; the sidecar lays the round out if it is the last arrival), and
   counts the rank as having left the job.
4. Hard timeout: when no watchdog line arrived for ``hard_timeout`` seconds (a thread holds
   the GIL), or the watchdog reports the function stalled that long, it sends SIGTERM, waits
   ``termination_grace_time``, sends SIGKILL, and writes the death notice as in 3.
5. Heartbeats: it adds 1 to its rank's counter in the store every ``heartbeat_interval``; it
   reads the counters of the round's other ranks and declares a rank whose counter did not move
   for ``heartbeat_timeout`` (by this process's own clock) gone, with the same notice.
6. It logs to ``<events dir or tmp>/sidecar-<rank>.log`` (and records ``rank_gone`` and
   ``hard_timeout`` events in the events directory) and exits after ``bye`` or a notice.

:class:`Sidecar` is the training process's handle.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from trainguard import _subproc
from trainguard.errors import CoordinationError

logger = logging.getLogger(__name__)


def log_path(directory: str | os.PathLike[str] | None, rank: int) -> Path:
    return Path(directory or tempfile.gettempdir()) / f"sidecar-{rank}.log"


class Sidecar:
    """Training-process side: start, send lines, notice the sidecar's death, stop."""

    def __init__(self, config: dict[str, Any], policies: Any) -> None:
        try:
            config["policies"] = base64.b64encode(pickle.dumps(policies)).decode()
        except Exception:  # lambdas: a sidecar that has to lay a round out uses ShiftRanks
            config["policies"] = None
        config["parent"] = os.getpid()
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self.error: str | None = None

    def start(self) -> Sidecar:
        self.proc = _subproc.start_module(
            "trainguard.restart._sidecar", self.config, stdin=subprocess.PIPE
        )
        self._stdin = self.proc.stdin
        return self

    def handshake(self, timeout: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        self.proc.stdout.close()
        try:
            reply = json.loads(line) if line else {"ok": False, "error": "no handshake"}
        except ValueError:
            reply = {"ok": False, "error": f"unreadable handshake {line!r}"}
        if not reply.get("ok"):
            self.stop(0.0)
            raise CoordinationError(
                f"the sidecar process could not start: {reply.get('error')}; see "
                f"{log_path(self.config['log_dir'], self.config['rank'])}"
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, message: dict[str, Any]) -> bool:
        """One line to the sidecar (from any thread); False if it is gone."""
        if self._stdin is None:
            return False
        try:
            self._stdin.write(json.dumps(message).encode() + b"\n")
            self._stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Say goodbye and wait for the exit (killed past ``timeout``); no zombie is left."""
        if self.proc is None:
            return
        self.send({"bye": 1})
        with contextlib.suppress(OSError):
            if self._stdin is not None:
                self._stdin.close()
        self._stdin = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("sidecar did not exit within %.1f s; killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# --- the sidecar process ---------------------------------------------------------------------


class _Watch:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from trainguard.coord.keys import Keyspace
        from trainguard.coord.store import connect

        self.cfg = cfg
        self.rank = int(cfg["rank"])
        self.world = int(cfg["world"])
        self.parent = int(cfg["parent"])
        self.keys = Keyspace(cfg["job"], cfg["call"])
        self.coord = connect(cfg["host"], cfg["port"], timeout=cfg["store_timeout"])
        self.round = -1
        self.roster: tuple[int, ...] = tuple(range(self.world))
        self.last_line = time.monotonic()
        self.in_fn = False
        self.stall = 0.0
        self.watchdog_started = False
        self.bye = False
        # heartbeats of the others: rank -> (counter, when it last moved by our clock)
        self.seen: dict[int, tuple[int, float]] = {}
        self.declared: set[int] = set()
        self.lock = threading.Lock()  # one notice at a time on self.coord
        for r in range(self.world):  # so that reading them never blocks on a missing key
            self.coord.add(self.hb_key(r), 0)

    def hb_key(self, r: int) -> str:
        return f"{self.keys.prefix}hb/{r}"

    # death notices -------------------------------------------------------------------------
    def session(self, roster: tuple[int, ...]) -> Any:
        from trainguard.restart._session import Session

        policies = self.cfg.get("policies")
        if policies:
            assignment, rank_filter, retry = pickle.loads(base64.b64decode(policies))
        else:
            from trainguard.restart.policy.assignment import ShiftRanks

            assignment, rank_filter, retry = ShiftRanks(), None, None

        class _Cfg:
            pass

        cfg = _Cfg()
        cfg.rank_assignment, cfg.rank_filter, cfg.retry = assignment, rank_filter, retry  # type: ignore[attr-defined]
        cfg.barrier_timeout = self.cfg["barrier_timeout"]  # type: ignore[attr-defined]
        cfg.store_timeout = self.cfg["store_timeout"]  # type: ignore[attr-defined]
        return Session.detached(
            keys=self.keys, world=self.world, coord=self.coord, cfg=cfg, roster=roster
        )

    def notice(self, r: int, n: int, roster: tuple[int, ...], cause: str) -> None:
        """Rank ``r`` (last seen in round ``n`` with ``roster``) is gone: tell the others."""
        from trainguard.coord.barrier import wait_key
        from trainguard.coord.keys import decode, encode

        # The rank may have arrived at later barriers before it died: follow it there.
        while self.coord.check([self.keys.member(n + 1, r)]):
            raw = wait_key(
                self.coord, self.keys.ready(n + 1), self.cfg["barrier_timeout"], what="barrier"
            )
            ready = decode(raw)
            n += 1
            roster = tuple(ready["active"]) + tuple(ready["spare"])
            if r not in roster or ready.get("end"):
                logger.info("rank %d is not in round %d; nothing to notify", r, n)
                return
        start = time.monotonic()
        if n >= 0:
            outcome = {
                "why": "fault",
                "rank": r,
                "error": cause,
                "type": "RankGone",
                "time": time.time(),
            }
            self.coord.compare_set(self.keys.stop(n), "", encode(outcome))
        counted = self.session(roster).depart(n + 1, r, cause)
        if counted and int(self.coord.add(self.keys.left, 1)) >= self.world:
            self.coord.set(self.keys.exit, b"done")
        from trainguard import events

        events.emit(
            "rank_gone",
            duration=time.monotonic() - start,
            gone_rank=r,
            gone_round=n,
            cause=cause,
            counted=counted,
        )
        logger.warning(
            "rank %d gone in round %d (%s); notice written in %.1f ms (counted: %s)",
            r,
            n,
            cause,
            1000 * (time.monotonic() - start),
            counted,
        )

    # the loop ------------------------------------------------------------------------------
    def handle(self, line: bytes) -> None:
        msg = json.loads(line)
        self.last_line = time.monotonic()
        if "hb" in msg:
            self.watchdog_started = True
            self.in_fn = bool(msg["in_fn"])
            self.stall = float(msg["stall"])
        elif "round" in msg:
            self.round = int(msg["round"])
            self.roster = tuple(msg["roster"])
            self.seen = {r: v for r, v in self.seen.items() if r in self.roster}
        elif "bye" in msg:
            self.bye = True

    def kill_parent(self, why: str, pidfd: int) -> str:
        grace = float(self.cfg["termination_grace_time"])
        from trainguard import events

        events.emit("hard_timeout", reason=why, pid=self.parent)
        logger.error("hard timeout: %s; SIGTERM to %d", why, self.parent)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.parent, signal.SIGTERM)
        ready, _, _ = select.select([pidfd], [], [], grace)
        if not ready:
            logger.error("still alive %.1f s after SIGTERM; SIGKILL", grace)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.parent, signal.SIGKILL)
            select.select([pidfd], [], [], 30.0)
        return f"killed by its sidecar at the hard timeout ({why})"

    def beat(self, store: Any) -> None:
        now = time.monotonic()
        store.add(self.hb_key(self.rank), 1)
        others = [r for r in self.roster if r != self.rank and r not in self.declared]
        if not others:
            return
        values = store.multi_get([self.hb_key(r) for r in others])
        timeout = float(self.cfg["heartbeat_timeout"])
        for r, raw in zip(others, values, strict=True):
            if bytes(raw) == b"bye":  # that rank finished normally
                self.declared.add(r)
                continue
            counter = int(raw) if raw else 0
            if counter == 0 or self.round < 0:
                continue  # judged only once it beat and every rank passed the first barrier
            previous = self.seen.get(r)
            if previous is None or previous[0] != counter:
                self.seen[r] = (counter, now)
            elif now - previous[1] >= timeout:
                self.declared.add(r)
                cause = f"silent: no heartbeat for {now - previous[1]:.1f} s (heartbeat_timeout)"
                with self.lock:
                    self.notice(r, self.round, self.roster, cause)

    def run(self) -> int:
        pidfd = os.pidfd_open(self.parent)
        stdin = sys.stdin.buffer
        os.set_blocking(stdin.fileno(), False)
        interval = float(self.cfg["heartbeat_interval"])
        hard = float(self.cfg["hard_timeout"])
        cause = self.loop(pidfd, stdin, interval, hard)
        if cause is not None:
            with self.lock:
                self.notice(self.rank, self.round, self.roster, cause)
        return 0

    def loop(self, pidfd: int, stdin: Any, interval: float, hard: float) -> str | None:
        """Until goodbye (None) or the training process's end (its cause)."""
        next_beat = time.monotonic()
        buf = b""
        eof = False
        while True:
            fds = [pidfd] if eof else [pidfd, stdin.fileno()]
            wait = max(0.0, next_beat - time.monotonic())
            ready, _, _ = select.select(fds, [], [], min(wait, interval))
            if stdin.fileno() in ready:
                chunk = os.read(stdin.fileno(), 65536)
                if not chunk:
                    eof = True
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(line)
                if self.bye:
                    logger.info("the training process said goodbye")
                    with contextlib.suppress(Exception), self.lock:
                        self.coord.set(self.hb_key(self.rank), b"bye")
                    return None
            if pidfd in ready:
                return f"process died ({_exit_status(self.parent)})"
            now = time.monotonic()
            if self.watchdog_started:
                silent = now - self.last_line
                if silent >= hard:
                    return self.kill_parent(f"no progress of any thread for {silent:.1f} s", pidfd)
                if self.in_fn and self.stall + silent >= hard:
                    return self.kill_parent(
                        f"the function made no progress for {self.stall + silent:.1f} s", pidfd
                    )
            if now >= next_beat:
                next_beat = now + interval
                try:
                    self.beat(self.coord)
                except Exception as exc:
                    logger.warning("heartbeat failed: %s", exc)


def _exit_status(pid: int) -> str:
    # Not our child: the exit status is its parent's to collect; /proc tells us nothing more.
    return f"pid {pid} exited"


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    path = log_path(cfg["log_dir"], cfg["rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=path,
        level=logging.INFO,
        format=f"%(asctime)s sidecar rank {cfg['rank']} pid %(process)d %(levelname)s %(message)s",
    )
    try:
        watch = _Watch(cfg)
    except Exception as exc:
        logger.exception("could not start")
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if cfg["log_dir"]:  # the events directory: the sidecar's detections are events too
        from trainguard import events

        events.configure(cfg["log_dir"], rank=cfg["rank"])
    logger.info("watching pid %d", cfg["parent"])
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    sys.stdout.close()
    try:
        return watch.run()
    except Exception:
        logger.exception("the sidecar failed")
        return 1
    finally:
        logging.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
