"""The shape of ``checkpoint/``: nothing below the local manager imports it (``TYPE_CHECKING``
imports included), and no module over 400 lines without the reason in its docstring (import
circles, ``TYPE_CHECKING`` included, are ``tests/test_codebase.py``'s, for the whole tree).

Read as text (``ast``); nothing is imported. ``tests/test_codebase.py`` holds the whole tree's
rules; these are the checkpoint package's own, stricter ones.
"""

from __future__ import annotations

import ast
import pathlib

from tests.test_codebase import _imports as imports
from tests.test_codebase import _modules as all_modules

ROOT = pathlib.Path(__file__).resolve().parents[2] / "src" / "trainguard"
CHECKPOINT = ROOT / "checkpoint"
MAX_LINES = 400
#: how a module over MAX_LINES says why, in its docstring
REASON = "Over 400 lines:"


def _modules() -> dict[str, pathlib.Path]:
    """The checkpoint package's modules (name -> path)."""
    return {m: p for m, p in all_modules().items() if m.startswith("trainguard.checkpoint")}


def test_nothing_below_the_local_manager_imports_it() -> None:
    """The manager holds its loader, pipeline and resources; none of them reaches back."""
    modules = _modules()
    manager = "trainguard.checkpoint.local.manager"
    importers = sorted(
        m
        for m, p in modules.items()
        if manager in imports(m, p, modules, every=True) and m != "trainguard.checkpoint.local"
    )
    assert importers == []


def test_modules_over_400_lines_say_why() -> None:
    unexplained = {}
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and REASON not in doc:
            unexplained[name] = lines
    assert unexplained == {}, (
        f"split these modules along a real seam, or say in their docstring why not "
        f"({REASON!r} ...): {unexplained}"
    )
