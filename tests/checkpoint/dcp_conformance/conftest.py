"""The two storage layers every conformance test runs on: torch's own file system layer and
trainguard's (see :mod:`._layers`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.checkpoint.dcp_conformance._layers import LAYERS, Layer


@pytest.fixture(params=LAYERS)
def layer(request: pytest.FixtureRequest) -> Iterator[Layer]:
    with Layer(request.param) as value:
        yield value
