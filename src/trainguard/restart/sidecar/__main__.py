"""The node watcher's process: ``python -m trainguard.restart.sidecar``, configured on stdin.

One per node and wrapped call (:mod:`._node`), started by the node's first rank
(:class:`trainguard.restart._helper.HelperHandle`); a fresh interpreter that shares nothing with
a crashing training process. This module is its entry point only: nothing imports it, so
``python -m`` runs it without importing it twice.

0. It reads the starting rank's :class:`~trainguard.restart.sidecar.SidecarConfig` (JSON) as
   the first line on its stdin: never on its command line, which every local user can read.
1. It binds the node's socket and prints one JSON handshake line on stdout, then forks: the
   watcher goes on in a child that outlives the rank that started it.
2. Every rank of the node (the first one included) then connects to that socket
   (:mod:`._node`'s protocol).

It never imports torch (~200 MB of memory and a second or two of CPU per process): it talks to
the store with the pure-Python client (:mod:`trainguard.coord._wire`). Policies the user pickled
into its configuration may import what they need.

It logs to :func:`~trainguard.restart.sidecar._node.log_path` (opened without following links)
and records ``rank_gone`` and ``hard_timeout`` events in the events directory.
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
from trainguard.restart.sidecar._node import NodeWatcher, log_path

logger = logging.getLogger("trainguard.restart.sidecar")


def _log_to(cfg: SidecarConfig) -> logging.Handler:
    """A handler on :func:`log_path` (never opened through a link); stderr when it does not
    open."""
    try:
        path = log_path(cfg)
        if cfg.log_dir:
            os.makedirs(path.parent, exist_ok=True)
        return logging.StreamHandler(os.fdopen(_private.open_append(path), "a", buffering=1))
    except (OSError, ValueError) as exc:
        print(f"node watcher: cannot log there: {exc}", file=sys.stderr)
    return logging.StreamHandler(sys.stderr)


def main() -> int:
    # a preemption signals every process of the job: the ranks save, this process watches
    # them until they end (and must not report them dead meanwhile)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _wire.activate()  # before any store connection: this process never imports torch
    try:
        raw, _ = _subproc.read_config()
        cfg = SidecarConfig.from_json(raw)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    logging.basicConfig(
        handlers=[_log_to(cfg)],
        level=logging.INFO,
        format="%(asctime)s node watcher pid %(process)d %(threadName)s %(levelname)s %(message)s",
    )
    try:
        watcher = NodeWatcher(cfg.keys)
    except Exception as exc:
        logger.exception("could not start")
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if os.fork():  # no thread runs yet: the watcher goes on in a child that outlives
        os._exit(0)  # the rank that started it, which reaps this process at once
    if cfg.log_dir:  # the events directory: the watcher's detections are events too
        events.configure(cfg.log_dir, rank=cfg.rank)
    logger.info("watching this node's ranks")
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    sys.stdout.close()
    try:
        logger.info("the last of %d ranks left", watcher.serve())
        return 0
    except Exception:
        logger.exception("the node watcher failed")
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    events.configure(None)
    # Threads may sit in store calls that cannot be interrupted; end without waiting for them.
    os._exit(code)
