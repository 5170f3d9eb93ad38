"""The sidecar process: ``python -m trainguard.restart.sidecar``, configured on its stdin.

One per rank, started by the wrapper, or one per node (``"node": true`` in its configuration:
the node watcher, :mod:`._node`), started by the node's first rank (:class:`trainguard.restart.sidecar.Sidecar`); a fresh
interpreter that shares nothing with a crashing training process. This module is its entry
point only: nothing imports it, so ``python -m`` runs it without importing it twice.

0. It reads its :class:`~trainguard.restart.sidecar.SidecarConfig` (JSON) as the first line on
   its stdin: never on its command line, which every local user can read.
1. It connects to the coordination store and prints one JSON handshake line on stdout.
2. The training process writes JSON lines on its stdin: ``{"round": n, "roster": [...]}`` after
   each barrier, ``{"hb": 1, "in_fn": bool, "stall": s}`` from its watchdog thread every few
   tenths of a second, ``{"bye": 1}`` when the wrapped call has left the job.

The watch itself (threads, hard timeout, heartbeats, notices) is
:class:`~trainguard.restart.sidecar._watch.Watch`, shared with the launcher's agent.

It never imports torch (~200 MB of memory and a second or two of CPU per process): it talks to
the store with the pure-Python client (:mod:`trainguard.coord._wire`). Policies the user pickled
into its configuration may import what they need.

It logs to :func:`~trainguard.restart.sidecar.log_path` (opened without following links) and
records ``rank_gone`` and ``hard_timeout`` events in the events directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from trainguard import _private, _subproc, events
from trainguard.coord import _wire
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import log_path, node_log_path, private_log
from trainguard.restart.sidecar._node import NodeWatcher
from trainguard.restart.sidecar._watch import Watch

logger = logging.getLogger("trainguard.restart.sidecar")


def _log_to(cfg: SidecarConfig, node: bool) -> logging.Handler:
    """A handler on the first log file that opens (:func:`log_path`, then this user's private
    directory; :func:`node_log_path` for a node watcher), never through a link; stderr when
    none does."""
    for place in (node_log_path,) if node else (log_path, private_log):
        try:
            path = place(cfg)
            if cfg.log_dir:
                os.makedirs(path.parent, exist_ok=True)
            return logging.StreamHandler(os.fdopen(_private.open_append(path), "a", buffering=1))
        except (OSError, ValueError) as exc:
            print(f"sidecar rank {cfg.rank}: cannot log there: {exc}", file=sys.stderr)
    return logging.StreamHandler(sys.stderr)


def main() -> int:
    # a preemption signals every process of the job: the rank saves, this process watches it
    # until it ends (and must not report it dead meanwhile)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _wire.activate()  # before any store connection: this process never imports torch
    try:
        raw, buf = _subproc.read_config()
        node = bool(raw.pop("node", False))
        cfg = SidecarConfig.from_json(raw)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    who = "node watcher" if node else f"sidecar rank {cfg.rank}"
    thread = "%(threadName)s " if node else ""
    logging.basicConfig(
        handlers=[_log_to(cfg, node)],
        level=logging.INFO,
        format=f"%(asctime)s {who} pid %(process)d {thread}%(levelname)s %(message)s",
    )
    try:
        watcher: Watch | NodeWatcher = NodeWatcher(cfg.keys) if node else Watch(cfg)
    except Exception as exc:
        logger.exception("could not start")
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if node and os.fork():  # no thread runs yet: the watcher goes on in a child that outlives
        os._exit(0)  # the rank that started it, which reaps this process at once
    if cfg.log_dir:  # the events directory: the sidecar's detections are events too
        events.configure(cfg.log_dir, rank=cfg.rank)
    logger.info("watching %s", "this node's ranks" if node else f"pid {cfg.parent}")
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    sys.stdout.close()
    try:
        if isinstance(watcher, NodeWatcher):
            logger.info("the last of %d ranks left", watcher.serve())
            return 0
        return watcher.run_piped(sys.stdin.buffer.fileno(), buf)
    except Exception:
        logger.exception("the sidecar failed")
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    events.configure(None)
    # Threads may sit in store calls that cannot be interrupted; end without waiting for them.
    os._exit(code)
