"""Run every benchmark under bench/ (each file not starting with '_'), one after another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: run on their own: `make compat` (builds a venv per torch release), `make gpu-check`
_SEPARATE = ("run_all.py", "compat.py", "gpu_check.py")


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("*.py")):
        if script.name.startswith("_") or script.name in _SEPARATE:
            continue
        print(f"=== {script.name}", flush=True)
        rc = subprocess.call([sys.executable, str(script), *sys.argv[1:]], cwd=HERE.parent)
        if rc:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
