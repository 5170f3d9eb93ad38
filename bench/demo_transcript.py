"""Put the output of a real ``trainguard demo`` run into the README and docs/demo.md.

Run: ``python bench/demo_transcript.py`` (about 30 s here). It runs the demo with its defaults,
drops the progress bars and the faults' ``cause:`` lines (they name this checkout's paths),
writes the run directory as ``/tmp/trainguard-demo-RUN``, and replaces the fenced blocks after
``<!-- fragment: output of trainguard demo -->`` in README.md (the fault and recovery lines)
and ``<!-- fragment: output of make demo -->`` in docs/demo.md (the whole transcript); with
``--picture`` it also copies the run's timeline to docs/demo-timeline.png.
tests/demo/test_demo_docs.py fails when the quoted lines no longer match the demo's default
schedule or the lines the demo prints.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MARK = "<!-- fragment: output of trainguard demo -->"
DEMO_MARK = "<!-- fragment: output of make demo -->"
RUN_NAME = "/tmp/trainguard-demo-RUN"


def transcript(out: Path) -> list[str]:
    """The demo's output lines, without progress bars and causes, run directory renamed."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    lines = []
    for line in proc.stdout.splitlines():
        if re.match(r"^\s*\[[#.]+\] step", line) or line.lstrip().startswith("cause: "):
            continue
        lines.append(line.replace(str(out), RUN_NAME).rstrip())
    return lines


def fault_lines(lines: list[str]) -> list[str]:
    """What the README quotes: the faults, the recoveries, the run's end and the verdict."""
    keep = ("  ! ", "  > ", "guarded run finished:", "bit-identical:")
    return [line for line in lines if line.startswith(keep)]


def replace_block(path: Path, mark: str, lines: list[str]) -> None:
    """Replace the fenced block right after the line ``mark`` in ``path`` with ``lines``."""
    text = path.read_text()
    pattern = re.compile(re.escape(mark) + r"\n```text\n.*?\n```\n", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no ```text block after {mark!r}")
    block = mark + "\n```text\n" + "\n".join(lines) + "\n```\n"
    path.write_text(pattern.sub(lambda _: block, text, count=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--picture", action="store_true", help="also update the timeline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainguard-demo-") as tmp:
        out = Path(tmp) / "run"
        lines = transcript(out)
        if args.picture:
            shutil.copy(out / "timeline.png", ROOT / "docs" / "demo-timeline.png")
    replace_block(ROOT / "README.md", README_MARK, fault_lines(lines))
    replace_block(ROOT / "docs" / "demo.md", DEMO_MARK, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
