"""The torch compatibility matrix: the project's suite on each torch release it claims.

For every version in :data:`VERSIONS` (the one list; ``--versions`` picks some of them, or
others) this builds a virtual environment under ``--venvs`` (cached: built once, reused while
its ``.ready`` marker is there), with that torch from the package registry (the CUDA builds
run on CPU), installs this checkout into it without dependencies (plus the few packages the
suite needs) and runs the compatibility suite, each step with a time limit:

- ``trainguard demo`` (4 ranks + 1 spare through five injected faults, bit-identical end);
- ``trainguard demo --launch`` (``--no-launch-demo`` leaves it out);
- the tests of :data:`TESTS`: the wire client and the store process, the DCP layer and its
  conformance suite (``tests/checkpoint/dcp_conformance``: DCP's own tests' behaviours, each
  on torch's file system layer and on trainguard's), the safe overwrite, the launcher's and
  trainguard's contract tests of torch internals.

Writes ``bench/results/compat.json`` (per version: passed, seconds, each step's result and
the tail of a failed step's output; a run of some versions keeps the others' last results)
and prints a table. ``make compat`` runs it; CI runs
``make test`` on the pinned torch only. Run it before each release and whenever
``trainguard._torchcompat`` or ``trainguard.launch._compat`` changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
#: torch releases of the matrix: the floor (pyproject.toml; also the pinned one) and the newest
#: release. 2.6.0, 2.7.1, 2.8.0, 2.10.0, 2.11.0 and 2.12.0 fail it, 2.14.0 passes (docs/compat.md;
#: ``--versions`` reruns them)
VERSIONS = ("2.13.0", "2.15.0")
#: what the suite needs besides torch and the project (installed without its dependencies)
EXTRA = ("xxhash>=3.0", "numpy>=1.24", "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")
TESTS = (
    "tests/coord/test_wire.py",
    "tests/coord/test_coord.py",
    "tests/restart/test_store_start.py",
    "tests/checkpoint/test_dcp_layer.py",
    "tests/checkpoint/test_dcp_interop.py",
    "tests/checkpoint/test_overwrite.py",
    "tests/checkpoint/dcp_conformance",
    "tests/live",
    "tests/launch/test_compat.py",
    "tests/test_torchcompat.py",
)
_TAIL = 3000  # characters of a failed step's output kept in the results


def _run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
        rc, out = done.returncode, done.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        rc, out = (
            -1,
            f"timed out after {timeout:g} s\n" + (exc.stdout or b"").decode(errors="replace"),
        )
    return {"rc": rc, "seconds": round(time.monotonic() - start, 1), "tail": out[-_TAIL:]}


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_CONSTRAINT"] = "/dev/null"  # the pinned torch of `make` must not constrain these
    return env


def build(venv: Path, version: str) -> dict[str, Any]:
    """The virtual environment for ``version`` (built unless ``.ready`` says it is)."""
    python = venv / "bin" / "python"
    if (venv / ".ready").exists():
        step = _run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
            timeout=300,
            env=_pip_env(),
        )
        step["cached"] = True
        return step
    venv.parent.mkdir(parents=True, exist_ok=True)
    made = _run([sys.executable, "-m", "venv", "--clear", str(venv)], timeout=120)
    if made["rc"]:
        return made
    step = _run(
        [str(python), "-m", "pip", "install", "-q", f"torch=={version}", *EXTRA],
        timeout=1800,
        env=_pip_env(),
    )
    if step["rc"] == 0:
        step = _run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
            timeout=300,
            env=_pip_env(),
        )
    if step["rc"] == 0:
        (venv / ".ready").write_text(version)
    step["cached"] = False
    return step


def suite(venv: Path, launch_demo: bool) -> dict[str, dict[str, Any]]:
    """Each step of the compatibility suite in ``venv``: name -> its result."""
    tg = str(venv / "bin" / "trainguard")
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    steps = {"demo": _run([tg, "demo"], timeout=600, env=env)}
    if launch_demo:
        steps["launch demo"] = _run([tg, "demo", "--launch"], timeout=600, env=env)
    steps["tests"] = _run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        timeout=900,
        env=env,
    )
    return steps


def _earlier() -> dict[str, Any]:
    """The results of earlier runs in bench/results/compat.json, by version."""
    try:
        payload = json.loads((RESULTS / "compat.json").read_text())
        found: dict[str, Any] = payload["results"]["versions"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return dict(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), help="torch releases")
    parser.add_argument(
        "--venvs",
        type=Path,
        default=Path.home() / ".cache" / "trainguard" / "compat-venvs",
        help="where the cached virtual environments live (one folder per version)",
    )
    parser.add_argument("--no-launch-demo", dest="launch_demo", action="store_false")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    rows = []
    for version in args.versions:
        print(f"=== torch {version}", flush=True)
        start = time.monotonic()
        venv = args.venvs / version
        setup = build(venv, version)
        steps = {"setup": setup}
        if setup["rc"] == 0:
            steps.update(suite(venv, args.launch_demo))
        passed = all(s["rc"] == 0 for s in steps.values())
        seconds = round(time.monotonic() - start, 1)
        results[version] = {
            "passed": passed,
            "seconds": seconds,
            "steps": {
                name: {k: v for k, v in s.items() if k != "tail" or s["rc"]}
                for name, s in steps.items()
            },
        }
        rows.append(
            [version, "yes" if passed else "NO", seconds]
            + [f"{'ok' if s['rc'] == 0 else 'FAIL'} {s['seconds']:.0f}s" for s in steps.values()]
        )
        for name, s in steps.items():
            print(f"  {name}: rc {s['rc']} in {s['seconds']} s", flush=True)
    steps_names = ["setup", "demo"] + (["launch demo"] if args.launch_demo else []) + ["tests"]
    print_table(
        "torch compatibility (bench/compat.py)",
        ["torch", "passed", "seconds", *steps_names],
        [r + [""] * (3 + len(steps_names) - len(r)) for r in rows],
    )
    earlier = _earlier()
    earlier.update(results)  # a run of some versions keeps the others' last results
    path = write_results("compat", {"versions": earlier, "tests": list(TESTS)})
    print(f"\nresults: {path}")
    return 0 if all(v["passed"] for v in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
