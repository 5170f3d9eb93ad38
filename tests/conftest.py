"""Suite-wide settings: which tests must not run beside each other under ``pytest -n``.

``make test`` runs the suite on three pytest-xdist workers (``--dist loadgroup``). Tests that
share something of the machine beyond their own processes, ports and temporary directories
run on one worker, one after the other: the emulated hosts (network namespaces, a bridge and
an address range are chosen by looking at what exists) and the soak (a tmpfs and a long,
timing-sensitive run of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_SERIAL = {_HERE / "cluster": "hosts", _HERE / "test_soak.py": "soak"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        for where, group in _SERIAL.items():
            if path == where or where in path.parents:
                item.add_marker(pytest.mark.xdist_group(group))
