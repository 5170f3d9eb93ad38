"""The documentation is true to the code: its code blocks run, its links resolve.

Every fenced code block of ``README.md``, ``CONTRIBUTING.md`` and ``docs/*.md`` is either run
here or marked, on the line right before it, as ``<!-- fragment: REASON -->`` (not run; the
reason is required) or ``<!-- file: NAME -->`` (written to ``NAME`` for a later block to use).
The blocks of one file run in order in one temporary directory: ``python`` blocks as scripts of
this interpreter, ``sh`` blocks with ``bash -e`` and this venv's ``bin/`` first on ``PATH``.
So the README's quick start runs as written. CONTRIBUTING.md documents the markers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
RUNNABLE = ("python", "sh")
#: seconds one block may run; the README's quick start starts a launcher and two ranks
BLOCK_TIMEOUT = 240.0
#: what each rank of the README's quick start prints at its end, as the README says it does
QUICK_START_END = "round 1 began at step 10, restored from memory; 40 steps done, w = -1.20"

_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(fragment|file):(.*?)-->\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its marker."""

    doc: Path
    line: int
    lang: str
    text: str
    marker: str | None  # "fragment", "file" or None
    arg: str  # the fragment's reason or the file's name

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def parse(doc: Path) -> tuple[list[Block], list[str]]:
    """The code blocks of ``doc`` and its lines outside code blocks."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        assert end < len(lines), f"{doc.relative_to(ROOT)}:{i + 1}: code block never closed"
        body = "\n".join(ln[len(indent) :] for ln in lines[i + 1 : end]) + "\n"
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        blocks.append(
            Block(
                doc,
                i + 1,
                lang,
                body,
                marker.group(1) if marker else None,
                marker.group(2).strip() if marker else "",
            )
        )
        i = end + 1
    return blocks, prose


def test_every_block_runs_or_is_marked() -> None:
    problems = []
    for doc in DOCS:
        for b in parse(doc)[0]:
            if b.marker == "fragment" and not b.arg:
                problems.append(f"{b.where()}: a fragment needs its reason: <!-- fragment: WHY -->")
            elif b.marker == "file" and not re.fullmatch(r"[\w.-]+", b.arg):
                problems.append(f"{b.where()}: <!-- file: NAME --> needs a plain file name")
            elif b.marker is None and b.lang not in RUNNABLE:
                problems.append(
                    f"{b.where()}: a {b.lang or 'plain'!r} block is not run: make it "
                    f"{' or '.join(RUNNABLE)}, or mark it <!-- fragment: WHY -->"
                )
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(m.group(2)) for ln in parse(doc)[1] if (m := _HEADING.match(ln))}


def test_relative_links_resolve() -> None:
    problems = []
    for doc in DOCS:
        for ln in parse(doc)[1]:
            for target in _LINK.findall(ln):
                if re.match(r"[a-z]+:", target):
                    continue  # a URL
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                where = f"{doc.relative_to(ROOT)}: link {target!r}"
                if not dest.is_relative_to(ROOT):
                    problems.append(f"{where} points outside the repository")
                elif not dest.exists():
                    problems.append(f"{where}: {dest.relative_to(ROOT)} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move reference text to docs/"


def _run(b: Block, cwd: Path) -> str:
    """Run one block in its own process group; fail on an error, a timeout or a leftover."""
    if b.lang == "python":
        script = cwd / f"_block_{b.line}.py"
        script.write_text(b.text, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-c", b.text]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TRAINGUARD_EVENTS_DIR", None)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{b.where()}: still running after {BLOCK_TIMEOUT:.0f} s:\n{out[-4000:]}")
    left = _leftovers(proc.pid)
    assert proc.returncode == 0, f"{b.where()}: exit status {proc.returncode}:\n{out[-4000:]}"
    assert not left, f"{b.where()}: left processes behind in its group"
    return out


def _leftovers(pgid: int, grace: float = 10.0) -> bool:
    """Whether processes of the group ``pgid`` outlived ``grace`` seconds (they are killed)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            return True
        time.sleep(0.1)


def _runnable_docs() -> list[Path]:
    return [d for d in DOCS if any(b.marker != "fragment" for b in parse(d)[0])]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", _runnable_docs(), ids=lambda d: str(d.relative_to(ROOT)))
def test_code_blocks_run(doc: Path, tmp_path: Path) -> None:
    outputs = []
    for b in parse(doc)[0]:
        if b.marker == "fragment" or b.lang not in RUNNABLE:
            continue  # an unmarked block in another language fails the test above
        if b.marker == "file":
            (tmp_path / b.arg).write_text(b.text, encoding="utf-8")
            continue
        outputs.append(_run(b, tmp_path))
    if doc.name == "README.md" and doc.parent == ROOT:
        out = "".join(outputs)
        for rank in (0, 1):
            assert f"rank {rank}: {QUICK_START_END}" in out, out[-4000:]
