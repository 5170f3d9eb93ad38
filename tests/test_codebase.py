"""The shape rules of the source tree: module and function sizes, no import circles.

These read the source as text (``ast``); nothing is imported or run.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "trainguard"
MAX_MODULE_LINES = 450  # issue 32: a smell detector, not a target (split along a seam)
MAX_FUNCTION_LINES = 80


def _modules(root: pathlib.Path = SRC) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


_BLOCKS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.For, ast.While)


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclasses.dataclass(frozen=True)
class _Import:
    """One import of a trainguard module by another, where it is written."""

    target: str
    line: int
    kind: str  # "module" (runs at import), "lazy" (inside a function or class) or "typing"


def _import_sites(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[_Import]:
    """Every import of a trainguard module in ``module``'s source: at module level, inside
    functions (lazy) and under ``if TYPE_CHECKING:`` (typing)."""
    found: list[_Import] = []

    def add(node: ast.stmt, kind: str) -> None:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            targets = [f"{target}.{a.name}" for a in node.names]
        else:
            return
        for name in targets:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                found.append(_Import(name, node.lineno, kind))

    def visit(body: list[ast.stmt], kind: str) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body, "typing")
                visit(node.orelse, kind)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, kind)
                visit(node.orelse, kind)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, kind)
                visit(getattr(node, "finalbody", []), kind)
            elif isinstance(node, _BLOCKS):
                visit(node.body, "lazy" if kind == "module" else kind)
            else:
                add(node, kind)

    visit(ast.parse(path.read_text()).body, "module")
    return found


def _imports(
    module: str, path: pathlib.Path, known: dict[str, pathlib.Path], *, every: bool
) -> set[str]:
    """The trainguard modules that ``module`` imports when it is imported.

    With ``every``, imports inside functions (they run at the first call) and under
    ``TYPE_CHECKING`` (a dependency of the design even where it never runs) count too.
    """
    sites = _import_sites(module, path, known)
    return {s.target for s in sites if every or s.kind == "module"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_module_is_too_long() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_too_long() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({lines} lines)")
    assert not long, f"split these functions (over {MAX_FUNCTION_LINES} lines): {long}"


@pytest.mark.parametrize("every", [False, True], ids=["module-level", "every-import"])
def test_no_import_circle(every: bool) -> None:
    """Imports between trainguard modules form no cycle: neither those that run at import time
    nor every import written (lazy ones in functions, ``TYPE_CHECKING`` ones included: a
    circle through a type annotation is still two modules that cannot be understood apart).

    A package ``__init__`` that re-exports its submodules is an edge like any other, so a
    submodule that imports from its own package's ``__init__`` shows up as a circle.
    """
    known = _modules()
    graph = {m: _imports(m, p, known, every=every) for m, p in known.items()}
    assert _cycles(graph) == []


# The layers of docs/design.md (its table says the same in prose), as the units each unit may
# import. A unit is a package
# directly under trainguard/ (its subpackages included) or a root module; ``trainguard`` is the
# root package's face. Nothing may import a unit that is not listed for it, at module level,
# lazily in a function or under TYPE_CHECKING.
_FLOOR_1 = {"errors"}
#: the ground floor: small helpers on the exception tree, then what reads the environment
_GROUND = _FLOOR_1 | {
    "_aborts",
    "_addr",
    "_env",
    "_errtext",
    "_hostlist",
    "_lazy",
    "_private",
    "_procfs",
    "_progress",
    "_settings",
    "_subproc",
    "_threads",
    "_timeouts",
    "_torchcompat",
    "events",
    "trainguard",
}
_WINGS = _GROUND | {"coord", "checkpoint", "restart", "stragglers", "report", "_teardown", "live"}
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "_aborts": set(),
    "_addr": _FLOOR_1,
    "_errtext": set(),
    "_hostlist": _FLOOR_1,
    "_lazy": set(),
    "_private": _FLOOR_1,
    "_procfs": set(),
    "_progress": _FLOOR_1,
    "_settings": _FLOOR_1 | {"_env", "_timeouts"},
    "_subproc": _FLOOR_1,
    "_threads": _FLOOR_1,
    "_timeouts": _FLOOR_1,
    "_torchcompat": _FLOOR_1,
    "trainguard": _FLOOR_1,
    "_env": _FLOOR_1 | {"_addr"},
    "events": _FLOOR_1 | {"_addr", "_env"},
    # stores, keys, commit, gather, escalation: on the ground floor only
    "coord": _GROUND,
    # uses coord, never restart or launch
    "checkpoint": _GROUND | {"coord"},
    # reads only event logs
    "report": _GROUND,
    # restart's scoring plug-in: restart may use it, it never reaches back into restart
    "stragglers": _GROUND | {"coord"},
    "restart": _GROUND | {"coord", "checkpoint", "stragglers"},
    # live-state recovery: beside restart (the training function calls it in each round),
    # on the checkpoint's flattening; restart does not import it
    "live": _GROUND | {"coord", "checkpoint"},
    # the end of a round for the integrations and the demo (beside restart)
    "_teardown": _GROUND | {"coord", "checkpoint"},
    # the agent: restart's faces and coord
    "launch": _GROUND | {"coord", "restart"},
    # the top floor: everything below it, nothing above; the CLI runs the demo's command
    "integrations": _WINGS | {"launch"},
    "demo": _WINGS | {"launch"},
    "cli": _WINGS | {"launch", "demo"},
    "__main__": {"cli"},
}

#: A package's private modules (``_x.py``, or any module under a ``_x`` component) are its
#: own: another unit imports the package's face or its public modules (the root's ``_x.py``
#: modules are the ground floor, shared by all). The exceptions, each for a reason (target
#: module -> the modules that may import it; a module, not its whole unit, so that another
#: module of the same unit reaching in is caught, as launch._jobsecret and restart._session
#: once did):
PRIVATE_ALLOWED: dict[str, set[str]] = {
    # coord is the low-level layer; these are its plumbing, shared by the layers above and no
    # API of its own: the job secret, the process's socket inventory (abort) and the
    # torch-free store client of the sidecar processes (which never import torch)
    "trainguard.coord._secret": {"trainguard.checkpoint._link", "trainguard.restart._session"},
    "trainguard.coord._sockets": {"trainguard.restart.abort"},
    "trainguard.coord._wire": {
        "trainguard.restart.sidecar.__main__",
        "trainguard.restart.sidecar._calls",
        "trainguard.restart.sidecar._node",
    },
    # the front ends (the CLI and the demo, on the top floor) render what the packages keep
    # off their public surface: the checkpoint subcommands, the report's plot and its
    # recovery line
    "trainguard.checkpoint._cli": {"trainguard.cli"},
    "trainguard.report._plot": {"trainguard.cli", "trainguard.demo._run"},
    "trainguard.report._reinit": {"trainguard.demo._run"},
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _private_of(target: str) -> bool:
    """True when ``target`` is a private module of a package (``trainguard.<pkg>...._x``)."""
    parts = target.split(".")
    return any(p.startswith("_") and not p.startswith("__") for p in parts[2:])


def _layering_breaks(known: dict[str, pathlib.Path]) -> list[str]:
    breaks: set[str] = set()
    for module, path in known.items():
        unit = _unit(module)
        for site in _import_sites(module, path, known):
            target = _unit(site.target)
            where = f"{module}:{site.line} ({site.kind})"
            if target == unit:
                continue
            if unit not in MAY_IMPORT:
                breaks.add(f"{where}: {unit} is not in MAY_IMPORT (place it in a layer)")
            elif target not in MAY_IMPORT[unit]:
                breaks.add(f"{where}: {unit} imports {site.target} (a layer up or aside)")
            elif _private_of(site.target) and module not in PRIVATE_ALLOWED.get(site.target, ()):
                breaks.add(f"{where}: {unit} imports {site.target}, private to {target}")
    return sorted(breaks)


def test_packages_import_only_downward() -> None:
    """Every import in src/ (module level, lazy and TYPE_CHECKING) follows :data:`MAY_IMPORT`
    and reaches another package only through its face or public modules."""
    breaks = _layering_breaks(_modules())
    assert not breaks, "imports against docs/design.md's layers:\n" + "\n".join(breaks)


def test_the_layer_table_names_every_unit() -> None:
    units = {_unit(m) for m in _modules()}
    assert units == set(MAY_IMPORT), (
        f"new units {units - set(MAY_IMPORT)}, gone {set(MAY_IMPORT) - units}: "
        "place them in MAY_IMPORT and in docs/design.md's table"
    )
    for target, importers in PRIVATE_ALLOWED.items():
        assert target in _modules(), f"PRIVATE_ALLOWED names {target}, which is gone"
        assert importers <= set(_modules()), f"{target}: {importers - set(_modules())} are gone"


def test_docs_design_describes_every_unit_of_the_layer_table() -> None:
    """docs/design.md is the layer table's prose: every unit of :data:`MAY_IMPORT` is named
    there (in backticks), and it names no unit that is gone."""
    text = (SRC.parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([A-Za-z_]+)`", text))
    missing = set(MAY_IMPORT) - named
    assert not missing, f"describe {sorted(missing)} in docs/design.md's table of floors"
    table = {
        cell
        for line in text.splitlines()
        if line.startswith("| ")
        for cell in re.findall(r"`([A-Za-z_]+)`", line.split("|")[2])
    }
    assert table <= set(MAY_IMPORT), (
        f"docs/design.md names units that are gone: {table - set(MAY_IMPORT)}"
    )


def test_the_layering_check_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    """A made-up tree with one break of each kind: a lazy import a layer up, a TYPE_CHECKING
    one aside, another package's private module, an allowed private one, and the same private
    module imported by another module of the allowed one's unit."""
    files = {
        "__init__.py": "",
        "errors.py": "",
        "coord/__init__.py": "",
        "coord/_sockets.py": "",
        "coord/_hidden.py": "",
        "stragglers/__init__.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from trainguard.restart import state\n"
        ),
        "restart/__init__.py": "",
        "restart/state.py": (
            "from trainguard import errors\nfrom ..coord._hidden import x\n"
            "def give_up():\n    from trainguard.launch import worker\n"
        ),
        "launch/__init__.py": "",
        "launch/worker.py": "from trainguard.restart import state\n",
        "restart/abort.py": "from trainguard.coord import _sockets\n",
        "restart/monitor.py": "from trainguard.coord._sockets import sockets\n",
    }
    root = tmp_path / "trainguard"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert _layering_breaks(_modules(root)) == [
        "trainguard.restart.monitor:1 (module): restart imports trainguard.coord._sockets, "
        "private to coord",
        "trainguard.restart.state:2 (module): restart imports trainguard.coord._hidden, "
        "private to coord",
        "trainguard.restart.state:4 (lazy): restart imports trainguard.launch.worker "
        "(a layer up or aside)",
        "trainguard.stragglers:3 (typing): stragglers imports trainguard.restart.state "
        "(a layer up or aside)",
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_finder_finds_cycles(source: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _cycles(source) == expected


def _untyped_stores(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every parameter or annotated attribute named like a store whose
    annotation is ``Any`` (or ``Any | None``): the coordination code passes ``StoreLike``."""

    def is_any(node: ast.expr | None) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "Any"
        if isinstance(node, ast.BinOp):  # Any | None
            return is_any(node.left) or is_any(node.right)
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and "store" in node.arg and is_any(node.annotation):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.AnnAssign) and is_any(node.annotation):
            target = node.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if "store" in name:
                found.append((node.lineno, name))
    return found


def test_no_store_is_typed_any() -> None:
    """Strict mypy checks the coordination code only where a store is typed: every store
    parameter and attribute is a ``StoreLike`` (or a concrete client), never ``Any``."""
    breaks = [
        f"{path.relative_to(SRC)}:{line}: {name}"
        for path in sorted(SRC.rglob("*.py"))
        for line, name in _untyped_stores(ast.parse(path.read_text()))
    ]
    assert not breaks, breaks
    # the check itself sees both kinds of annotation
    sample = "def f(store: Any, x: int): ...\nclass C:\n    def g(self):\n        self._store: Any | None = None\n"
    assert [n for _, n in _untyped_stores(ast.parse(sample))] == ["store", "_store"]


def test_a_module_over_400_lines_says_why() -> None:
    """About 400 lines is a module's size (issue 32); one above it says why in its docstring
    ("Over 400 lines: ..."), or is split along a seam."""
    unexplained = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400 and "Over 400 lines:" not in (
            ast.get_docstring(ast.parse(text)) or ""
        ):
            unexplained.append(str(path.relative_to(SRC)))
    assert not unexplained, unexplained
