"""The shape of ``checkpoint/``: nothing below the local manager imports it (``TYPE_CHECKING``
imports included), and no module over 400 lines without the reason in its docstring (import
circles, ``TYPE_CHECKING`` included, are ``tests/test_codebase.py``'s, for the whole tree).

Read as text (``ast``); nothing is imported. ``tests/test_codebase.py`` holds the whole tree's
rules; these are the checkpoint package's own, stricter ones.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "src" / "trainguard"
CHECKPOINT = ROOT / "checkpoint"
MAX_LINES = 400
#: how a module over MAX_LINES says why, in its docstring
REASON = "Over 400 lines:"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(CHECKPOINT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _every_import(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The checkpoint modules ``module`` imports anywhere: at module level, in functions, and
    under ``if TYPE_CHECKING:`` (an annotation's dependency is a dependency of the design)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    found.add(f"{target}.{alias.name}")
                elif target in known:
                    found.add(target)
    found.discard(module)
    return found


def test_nothing_below_the_local_manager_imports_it() -> None:
    """The manager holds its loader, pipeline and resources; none of them reaches back."""
    modules = _modules()
    known = set(modules)
    manager = "trainguard.checkpoint.local.manager"
    importers = sorted(
        m
        for m, p in modules.items()
        if manager in _every_import(m, p, known) and m != "trainguard.checkpoint.local"
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
