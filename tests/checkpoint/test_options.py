"""The checkpointers' settings: keyword-only frozen dataclasses, checked when built.

A bad value raises ConfigError naming the setting and the fix, when the options (or the
checkpointer) are built, before any process starts or any directory is made.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from trainguard.checkpoint import (
    AsyncCheckpointer,
    AsyncOptions,
    CliqueReplication,
    LocalCheckpointManager,
    LocalOptions,
)
from trainguard.errors import ConfigError

SHARED_BAD = [
    ({"staging_threads": 0}, r"staging_threads=0: must be a whole number >= 1; give the number"),
    ({"staging_threads": 1.5}, r"staging_threads=1.5: must be a whole number"),
    ({"writer_nice": 20}, r"writer_nice=20: must be a whole number between 0 and 19"),
    ({"writer_nice": True}, r"writer_nice=True: must be a whole number"),
    ({"pin_memory": "yes"}, r"pin_memory='yes': pass True or False"),
    ({"fsync": None}, r"fsync=None: pass True or False"),
    ({"key_prefix": ""}, r"key_prefix='': give a non-empty string"),
]

ASYNC_BAD = [
    *SHARED_BAD,
    ({"commit_timeout": 0}, r"commit_timeout=0: must be a positive, finite number of seconds"),
    ({"start_timeout": "10"}, r"start_timeout='10': give seconds \(a number\) or a datetime"),
    ({"close_timeout": float("inf")}, r"close_timeout=inf: must be a positive, finite"),
    ({"close_timeout": timedelta(0)}, r"close_timeout=0.0: must be a positive, finite"),
]

LOCAL_BAD = [
    *SHARED_BAD,
    ({"replication": 2}, r"replication=2: pass CliqueReplication\(factor, jump\), or None"),
    ({"keep": 0}, r"keep=0: keep at least 1 complete iteration"),
    ({"keep": True}, r"keep=True: keep at least 1"),
    ({"backend": "mpi"}, r"backend='mpi'; use 'gloo' \(CPU\) or 'nccl' \(GPU\)"),
    ({"timeout": -1}, r"timeout=-1: must be a positive, finite number of seconds"),
    ({"spare_interval": timedelta(seconds=-1)}, r"spare_interval=-1.0: must be a positive"),
    ({"allow_replication_change": "no"}, r"allow_replication_change='no': pass True or False"),
    ({"spare_roots": "/dev/shm/x"}, r"give a list of directories \(spare_roots=\['/dev/shm/x'\]\)"),
    ({"spare_roots": [3]}, r"spare_roots=\[3\]: give a list of directory paths"),
]


def _no_children() -> bool:
    return not multiprocessing.active_children()


@pytest.mark.parametrize(("kwargs", "message"), ASYNC_BAD)
def test_a_bad_async_setting_names_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncOptions(**kwargs)
    with pytest.raises(ConfigError, match=message):
        AsyncCheckpointer(**kwargs)  # the constructor's keywords: refused before the writer
    assert _no_children()


@pytest.mark.parametrize(("kwargs", "message"), LOCAL_BAD)
def test_a_bad_local_setting_names_the_fix(
    kwargs: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        LocalOptions(**kwargs)
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match=message):
        LocalCheckpointManager(root, **kwargs)
    assert not root.exists()  # refused before anything was made
    assert _no_children()


def test_timeouts_take_seconds_or_timedelta_and_read_back_as_seconds() -> None:
    a = AsyncOptions(commit_timeout=timedelta(minutes=2), start_timeout=5, close_timeout=7.5)
    assert (a.commit_timeout, a.start_timeout, a.close_timeout) == (120.0, 5.0, 7.5)
    assert all(isinstance(v, float) for v in (a.commit_timeout, a.start_timeout))
    local = LocalOptions(timeout=timedelta(seconds=30), spare_interval=1, spare_roots=[Path("/x")])
    assert (local.timeout, local.spare_interval, local.spare_roots) == (30.0, 1.0, ("/x",))


def test_options_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        AsyncOptions(4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        LocalOptions(CliqueReplication(2))  # type: ignore[misc]
    options = LocalOptions(keep=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.keep = 1  # type: ignore[misc]


def test_the_constructors_build_their_options_or_take_them(tmp_path: Path) -> None:
    with AsyncCheckpointer(commit_timeout=60, writer_nice=5) as ckpt:
        assert ckpt.options == AsyncOptions(commit_timeout=60, writer_nice=5)
        assert ckpt.commit_timeout == 60.0
    given = AsyncOptions(close_timeout=timedelta(seconds=90), fsync=False)
    with AsyncCheckpointer(options=given) as ckpt:
        assert ckpt.options is given and ckpt.close_timeout == 90.0
    local = LocalOptions(keep=3, replication=CliqueReplication(2, jump=1))
    with LocalCheckpointManager(tmp_path / "a", options=local) as mgr:
        assert mgr.options is local and mgr.keep == 3
        assert mgr.setting == "CliqueReplication(factor=2, jump=1)"


def test_options_and_keywords_at_once_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pass them one way"):
        AsyncCheckpointer(fsync=False, options=AsyncOptions(writer_nice=3))
    with pytest.raises(ConfigError, match="pass them one way"):
        LocalCheckpointManager(tmp_path / "b", keep=4, options=LocalOptions(keep=3))
    with pytest.raises(ConfigError, match="pass a LocalOptions"):
        LocalCheckpointManager(tmp_path / "c", options=AsyncOptions())  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert _no_children()
