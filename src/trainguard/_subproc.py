"""Start a trainguard helper process (store server, sidecar) as a fresh interpreter.

The child runs ``python -m MODULE`` with this very trainguard first on its path, even when
trainguard is not installed, and never re-imports the user's ``__main__``. Its configuration
(which may hold the job secret and pickled policies) is the first line on its stdin, never on
its command line, which every user of the machine can read in ``/proc/PID/cmdline``; the child
reads it with :func:`read_config`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def start_module(
    module: str, config: dict[str, Any], *, keep_stdin: bool, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """Popen ``python -m module`` with stdout piped (for the handshake) and ``config`` sent as
    the first line on its stdin; the pipe stays open for more lines when ``keep_stdin``.
    ``new_session``: the child leads a session of its own (a kill of this process's group
    does not reach it)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
        env=env,
        start_new_session=new_session,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(config).encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        pass  # it died at start: the handshake says so
    if not keep_stdin:
        proc.stdin.close()
    return proc


def read_config(fd: int = 0) -> tuple[dict[str, Any], bytes]:
    """In the child: the configuration line from ``fd`` and what followed it in the read.

    Reads with ``os.read`` (no buffered reader that could keep later lines); raises
    ``ValueError`` for a missing or unreadable line.
    """
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    config = json.loads(line)
    if not isinstance(config, dict):
        raise ValueError("the configuration line is not a JSON object")
    return config, rest


def exit_text(code: object) -> str:
    """How a process ended, from its exit status (a ``Popen.returncode``: negative for a
    signal): ``"exit code 3"``, ``"killed by signal SIGKILL"``, ``"exit status unknown"``."""
    if type(code) is not int:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
