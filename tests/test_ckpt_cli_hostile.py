"""`trainguard ckpt verify` judges a file as `load` does; `show` never prints a file's control
characters; unreadable files and run directories give one line and exit status 1."""

from __future__ import annotations

import json
import pathlib
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._craft import file_bytes, rewrite, with_skeleton


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120
    )


def _write(path: Path, blob: bytes) -> str:
    path.write_bytes(blob)
    return str(path)


def _state() -> dict[str, Any]:
    return {"w": torch.arange(6, dtype=torch.float32), "step": 3}


def _skeleton(change: dict[str, Any]) -> bytes:
    node = {"T": "w", "dtype": "float32", "shape": [6], **change}
    return rewrite(file_bytes(_state()), lambda h: with_skeleton(h, {"D": [["w", node]]}))


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (_skeleton({"T": "gone"}), "tensor 'gone' is missing"),
        (_skeleton({"shape": [7]}), "needs 28 bytes"),
        (_skeleton({"dtype": "float64", "shape": [6]}), "needs 48 bytes"),
    ],
)
def test_verify_fails_what_load_rejects(blob: bytes, problem: str, tmp_path: Path) -> None:
    out = _cli("ckpt", "verify", _write(tmp_path / "x.safetensors", blob))
    assert out.returncode == 1 and "FAIL" in out.stdout and problem in out.stdout, out.stdout


class _Touch:
    """Unpickling it creates a file: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_verify_refuses_pickle_without_opt_in_and_never_unpickles(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    state = {"w": torch.ones(2), "obj": _Touch(str(marker))}
    path = _write(tmp_path / "p.safetensors", file_bytes(state, pickle=True))
    pickle.dumps(state["obj"])  # sanity: it pickles
    out = _cli("ckpt", "verify", path)
    assert out.returncode == 1 and "allow_pickle" in out.stdout, out.stdout
    out = _cli("ckpt", "verify", "--allow-pickle", path)
    assert out.returncode == 0, out.stdout
    out = _cli("ckpt", "ls", str(tmp_path))
    assert "complete" in out.stdout
    assert not marker.exists()


def test_show_escapes_control_characters(tmp_path: Path) -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\u202etxt"
    path = _write(tmp_path / f"{evil}.safetensors", file_bytes({evil: torch.ones(1), "s": 1}))
    for args in (("ckpt", "show", path), ("ckpt", "ls", str(tmp_path)), ("ckpt", "verify", path)):
        out = _cli(*args)
        assert out.returncode == 0, out.stdout + out.stderr
        for ch in ("\x1b", "\x07", "\u202e"):
            assert ch not in out.stdout + out.stderr
        assert "\\x1b]0;pwned\\x07" in out.stdout


def _one_line_failure(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_unreadable_files_give_one_line(tmp_path: Path) -> None:
    _one_line_failure(_cli("ckpt", "show", "/proc/self/mem"))  # reading it fails with EIO
    run = tmp_path / "run"
    (run / "events-h-1.jsonl").mkdir(parents=True)  # a directory where a log belongs
    _one_line_failure(_cli("events", str(run)))
    _one_line_failure(_cli("report", str(run)))


def test_events_and_report_skip_malformed_fields(tmp_path: Path) -> None:
    from trainguard import events, report

    good = [
        {"time": 100.0, "kind": "round_start", "rank": 0, "round": 0},
        {"time": 101.0, "kind": "train_step", "rank": 0, "round": 0, "step": 1, "duration": 0.5},
        {"time": 102.0, "kind": "complete", "rank": 0, "round": 0},
    ]
    bad = [
        {"time": "soon", "kind": "x"},
        {"time": 1e999, "kind": "x"},
        {"time": float("nan"), "kind": "x"},
        {"time": True, "kind": "x"},
        {"time": 101.5, "kind": "train_step", "rank": "zero", "step": 2},
        {"time": 101.5, "kind": "train_step", "rank": 0, "step": [2]},
        {"time": 101.5, "kind": "train_step", "rank": 0, "duration": "long"},
        {"time": 101.5, "kind": "train_step", "rank": 0, "duration": -1},
        {"time": 101.5, "kind": ["fault"], "rank": 0},
        {"time": 101.5, "kind": "abort", "rank": 0, "gone_round": "1"},
        [1, 2],
    ]
    lines = [json.dumps(e) for e in good + bad] + ["[" * 100_000 + "]" * 100_000]
    (tmp_path / "events-h-1.jsonl").write_text("\n".join(lines) + "\n")
    assert events.read_events(tmp_path) == good
    assert report.analyze(bad[:10] + good).wall == pytest.approx(2.0)  # type: ignore[arg-type]
    for cmd in ("events", "report"):
        out = _cli(cmd, str(tmp_path))
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
