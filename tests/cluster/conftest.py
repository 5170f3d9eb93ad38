"""Fixtures for tests on emulated hosts (see ``_hosts.py``).

``cluster(n)`` makes ``n`` hosts for the test; at its end every host is torn down and the
fixture fails the test if anything of a cluster is left (a namespace, a link, a file, a
process). Without root or ``ip``, the tests that use it are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster._hosts import Cluster, leftovers, unavailable

_WHY = unavailable()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[[int], Cluster]]:
    if _WHY is not None:
        pytest.skip(_WHY)
    made: list[Cluster] = []

    def make(n: int) -> Cluster:
        c = Cluster(tmp_path, n)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
    left = [x for c in made for x in leftovers(c.id)]
    assert not left, f"emulated hosts left behind: {left}"
