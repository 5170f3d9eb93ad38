"""The sidecar process: ``python -m trainguard.restart.sidecar``, configured on its stdin.

One per rank, started by the wrapper (:class:`trainguard.restart.sidecar.Sidecar`); a fresh
interpreter that shares nothing with a crashing training process. This module is its entry
point only: nothing imports it, so ``python -m`` runs it without importing it twice.

0. It reads its :class:`~trainguard.restart.sidecar.SidecarConfig` (JSON) as the first line on
   its stdin: never on its command line, which every local user can read.
1. It connects to the coordination store and prints one JSON handshake line on stdout.
2. The training process writes JSON lines on its stdin: ``{"round": n, "roster": [...]}`` after
   each barrier, ``{"hb": 1, "in_fn": bool, "stall": s}`` from its watchdog thread every few
   tenths of a second, ``{"bye": 1}`` when the wrapped call has left the job.

Three threads, so that no store operation ever delays the two duties that must be on time
(a TCPStore operation on a server that stopped answering blocks far past its timeout):

- main: waits in ``select`` on a pidfd of the training process and on the pipe. The pidfd
  wakes it at the death (no timer); it then writes the death notice (:mod:`._notice`) on its
  own store connection. Before that it does no store work at all. Signals go through the
  pidfd too (``pidfd_send_signal``), so they can never reach a process that reused the pid.
- ``tg-hard``: the hard timeout, with no store access. When no watchdog line arrived for
  ``hard_timeout`` (a thread holds the GIL), or the watchdog reports the function stalled that
  long, it sends SIGTERM, waits ``termination_grace_time``, sends SIGKILL; the main thread then
  sees the death and writes the notice.
- ``tg-beats``: counts this rank's counter up every ``heartbeat_interval`` and reads the
  others' counters (one ``multi_get``); a rank whose counter did not move for
  ``heartbeat_timeout`` by this process's clock is gone: a ``tg-notice`` thread with its own
  connection writes the notice, so a notice waiting on a barrier never stops the beats. A
  value that is not a counter counts as a counter that does not move.

It logs to :func:`~trainguard.restart.sidecar.log_path` (opened without following links) and
records ``rank_gone`` and ``hard_timeout`` events in the events directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from trainguard import _private, _subproc, events
from trainguard.coord.store import connect
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import log_path, private_log
from trainguard.restart.sidecar._notice import write_notice

logger = logging.getLogger("trainguard.restart.sidecar")


class _Watch:
    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.world = cfg.world
        self.parent = cfg.parent
        self.keys = cfg.keys
        self.coord = connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
        self.beat_store = self.coord.clone()
        self.pidfd = os.pidfd_open(self.parent)
        self.lock = threading.Lock()  # guards the fields below, shared by the threads
        self.round = -1
        self.roster: tuple[int, ...] = tuple(range(self.world))
        self.last_line = time.monotonic()
        self.in_fn = False
        self.stall = 0.0
        self.killed: str | None = None  # set by tg-hard before its SIGTERM
        self.done = threading.Event()  # the training process is gone or said goodbye
        self.notices: list[threading.Thread] = []
        # heartbeats of the others: rank -> (counter, when it last moved by our clock)
        self.seen: dict[int, tuple[int, float]] = {}
        self.declared: set[int] = set()
        self.last_beat = time.monotonic()
        self.sent = 0  # this rank's heartbeat counter
        # Every counter must exist so that reading them never blocks on a missing key. Not by
        # add(): a TCPStore server drops the connection of an add to a value that is no number.
        for r in range(self.world):
            self.coord.compare_set(self.keys.heartbeat(r), "", b"0")

    # tg-hard: the hard timeout, no store access -------------------------------------------
    def enforce_hard_timeout(self) -> None:
        hard = self.cfg.hard_timeout
        while not self.done.is_set():
            now = time.monotonic()
            with self.lock:  # the clock starts at the handshake, before the first line
                silent = now - self.last_line
                stalled = self.stall + silent if self.in_fn else 0.0
            if silent >= hard:
                self.kill_parent(f"no progress of any thread for {silent:.1f} s")
                return
            if stalled >= hard:
                self.kill_parent(f"the function made no progress for {stalled:.1f} s")
                return
            # wake at the earliest deadline; a new line only moves it later
            self.done.wait(max(0.001, hard - max(silent, stalled)))

    def kill_parent(self, why: str) -> None:
        grace = self.cfg.termination_grace_time
        self.killed = f"killed by its sidecar at the hard timeout ({why})"
        events.emit("hard_timeout", reason=why, pid=self.parent)
        logger.error("hard timeout: %s; SIGTERM to %d", why, self.parent)
        with contextlib.suppress(ProcessLookupError):  # gone already: nothing else is hit
            signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
        ready, _, _ = select.select([self.pidfd], [], [], grace)
        if not ready:
            logger.error("still alive %.1f s after SIGTERM; SIGKILL", grace)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    # tg-beats: heartbeats and verdicts ------------------------------------------------------
    def beats(self) -> None:
        interval = self.cfg.heartbeat_interval
        next_beat = time.monotonic()
        while not self.done.wait(max(0.0, next_beat - time.monotonic())):
            next_beat = max(next_beat + interval, time.monotonic())
            try:
                self.beat()
            except Exception as exc:
                logger.warning("heartbeat failed: %s", exc)

    def beat(self) -> None:
        store = self.beat_store
        asked = time.monotonic()
        self.sent += 1  # set, not add: whatever another writer left there is overwritten
        store.set(self.keys.heartbeat(self.rank), str(self.sent))
        with self.lock:
            n, roster = self.round, self.roster
        others = [r for r in roster if r != self.rank and r not in self.declared]
        if not others or n < 0:  # judged once every rank passed the first barrier
            return
        values = store.multi_get([self.keys.heartbeat(r) for r in others])
        now = time.monotonic()
        timeout = self.cfg.heartbeat_timeout
        if now - self.last_beat > max(timeout / 2, 2 * self.cfg.heartbeat_interval):
            # This process saw nothing for a while (the store did not answer, or this process
            # got no CPU): that time says nothing about the others. Start their clocks afresh.
            self.seen = {}
        self.last_beat = asked
        self.seen = {r: v for r, v in self.seen.items() if r in roster}
        for r, raw in zip(others, values, strict=True):
            if bytes(raw) == b"bye":  # that rank finished normally
                self.declared.add(r)
                continue
            counter = _counter(bytes(raw))
            if counter == 0:
                continue  # judged only once it beat
            previous = self.seen.get(r)
            if previous is None or previous[0] != counter:
                self.seen[r] = (counter, now)
            elif now - previous[1] >= timeout:
                self.declared.add(r)
                cause = f"silent: no heartbeat for {now - previous[1]:.1f} s (heartbeat_timeout)"
                logger.warning("rank %d is %s", r, cause)
                thread = threading.Thread(
                    target=self.notice, args=(None, r, n, roster, cause), name="tg-notice"
                )
                thread.daemon = True
                thread.start()
                self.notices.append(thread)

    # notices -----------------------------------------------------------------------------
    def notice(self, store: Any, r: int, n: int, roster: tuple[int, ...], cause: str) -> None:
        try:
            if store is None:
                store = self.coord.clone()  # a connection of this notice's own
            done = write_notice(store, self.cfg, r, n, roster, cause)
        except Exception:
            logger.exception("could not write the notice that rank %d is gone", r)
            return
        logger.warning(
            "rank %d gone in round %d (%s); notice written in %.1f ms (counted: %s)",
            r,
            done.gone_round,
            cause,
            1000 * done.duration,
            done.counted,
        )

    # main thread ---------------------------------------------------------------------------
    def handle(self, line: bytes) -> bool:
        """One line from the training process; True for its goodbye."""
        msg = json.loads(line)
        with self.lock:
            self.last_line = time.monotonic()
            if "hb" in msg:
                self.in_fn = bool(msg["in_fn"])
                self.stall = float(msg["stall"])
            elif "round" in msg:
                self.round = int(msg["round"])
                self.roster = tuple(msg["roster"])
        return "bye" in msg

    def wait_parent(self, buf: bytes = b"") -> str | None:
        """Until goodbye (None) or the training process's death (its cause). ``buf``: what
        was read from stdin after the configuration line."""
        stdin = sys.stdin.buffer.fileno()
        os.set_blocking(stdin, False)
        eof = False
        while True:
            ready, _, _ = select.select([self.pidfd] if eof else [self.pidfd, stdin], [], [])
            # the pipe first: a goodbye written just before a normal exit is not a death
            while not eof:
                try:
                    chunk = os.read(stdin, 65536)
                except BlockingIOError:
                    break
                eof = not chunk
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if any(self.handle(line) for line in lines if line.strip()):
                    return None
            if self.pidfd in ready:
                return self.killed or f"process died (pid {self.parent} exited)"

    def run(self, buf: bytes = b"") -> int:
        threads = [
            threading.Thread(target=self.enforce_hard_timeout, name="tg-hard", daemon=True),
            threading.Thread(target=self.beats, name="tg-beats", daemon=True),
        ]
        for thread in threads:
            thread.start()
        cause = self.wait_parent(buf)
        self.done.set()
        threads[0].join()  # never blocked: it only waits on the pidfd and the event
        if cause is None:
            logger.info("the training process said goodbye")
            with contextlib.suppress(Exception):  # the store may be gone with the job
                self.coord.set(self.keys.heartbeat(self.rank), b"bye")
        else:
            with self.lock:
                n, roster = self.round, self.roster
            self.notice(self.coord, self.rank, n, roster, cause)
        # Notices about others still running go on up to the barrier timeout; a beat stuck in
        # a store call is not waited for (the process exits under it).
        deadline = time.monotonic() + self.cfg.barrier_timeout
        for thread in self.notices:
            thread.join(max(0.0, deadline - time.monotonic()))
        threads[1].join(0.5)
        return 0


def _counter(raw: bytes) -> int:
    """A heartbeat counter read from the store; -1 for a value that is no counter."""
    return int(raw) if raw.isdigit() else (0 if not raw else -1)


def _log_to(cfg: SidecarConfig) -> logging.Handler:
    """A handler on the first log file that opens (:func:`log_path`, then this user's private
    directory), never through a link; stderr when none does."""
    for place in (log_path, private_log):
        try:
            path = place(cfg)
            if cfg.log_dir:
                os.makedirs(path.parent, exist_ok=True)
            return logging.StreamHandler(os.fdopen(_private.open_append(path), "a", buffering=1))
        except (OSError, ValueError) as exc:
            print(f"sidecar rank {cfg.rank}: cannot log there: {exc}", file=sys.stderr)
    return logging.StreamHandler(sys.stderr)


def main() -> int:
    try:
        raw, buf = _subproc.read_config()
        cfg = SidecarConfig.from_json(raw)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    logging.basicConfig(
        handlers=[_log_to(cfg)],
        level=logging.INFO,
        format=f"%(asctime)s sidecar rank {cfg.rank} pid %(process)d %(levelname)s %(message)s",
    )
    try:
        watch = _Watch(cfg)
    except Exception as exc:
        logger.exception("could not start")
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if cfg.log_dir:  # the events directory: the sidecar's detections are events too
        events.configure(cfg.log_dir, rank=cfg.rank)
    logger.info("watching pid %d", cfg.parent)
    watch.last_line = time.monotonic()
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    sys.stdout.close()
    try:
        return watch.run(buf)
    except Exception:
        logger.exception("the sidecar failed")
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    events.configure(None)
    # Threads may sit in store calls that cannot be interrupted; end without waiting for them.
    os._exit(code)
