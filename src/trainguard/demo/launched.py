"""One demo process started by ``trainguard launch`` (``trainguard demo --launch``).

``python -m trainguard.demo.launched CONFIG REF_PORT``: ``CONFIG`` is the run's
:class:`~trainguard.demo.worker.DemoConfig` as JSON, ``REF_PORT`` the port of the fault-free
reference run. The process number is the slot's ``RANK`` (kept by a respawned process and by
the workers of a replacement node); only the first processes of ranks ``0..ranks-1`` of the
first generation take part in the reference run. Messages go to a JSON-lines file of this
process alone, ``<out>/channels/process-<RANK>-<pid>.jsonl``, which ``trainguard demo`` reads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainguard import _env
from trainguard.demo._channel import FileChannel
from trainguard.demo.worker import DemoConfig, run_process
from trainguard.errors import ConfigError

__all__ = ["channel_path", "main"]


def channel_path(out: str | os.PathLike[str], process: int, pid: int) -> Path:
    """The message file of process ``process`` with pid ``pid``."""
    return Path(out) / "channels" / f"process-{process}-{pid}.jsonl"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit() or "RANK" not in os.environ:
        raise ConfigError(
            "usage: trainguard launch ... -m trainguard.demo.launched CONFIG REF_PORT "
            "(trainguard demo --launch starts it)"
        )
    cfg = DemoConfig.from_json(Path(args[0]).read_text())
    process = int(os.environ["RANK"])
    settings = _env.settings()
    first = settings.incarnation == 0 and not settings.generation
    channel = FileChannel(channel_path(cfg.out, process, os.getpid()))
    run_process(
        cfg, process, channel, ref_port=int(args[1]), in_reference=first and process < cfg.ranks
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
