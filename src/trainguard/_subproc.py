"""Start a trainguard helper process (store server, sidecar) as a fresh interpreter.

The child runs ``python -m MODULE CONFIG_JSON`` with this very trainguard first on its path,
even when trainguard is not installed, and never re-imports the user's ``__main__``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def start_module(module: str, config: dict[str, Any], *, stdin: Any) -> subprocess.Popen[bytes]:
    """Popen ``python -m module json(config)`` with stdout piped (for the handshake)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", module, json.dumps(config)],
        stdin=stdin,
        stdout=subprocess.PIPE,
        close_fds=True,
        env=env,
    )
