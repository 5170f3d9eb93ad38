"""Package faces whose names are imported at first use.

A face that must stay cheap to import (the checkpoint package, which the torch-free writer
process imports; the launcher, whose workers must not import ``torch.distributed.elastic``)
lists where each public name lives and gets its module ``__getattr__`` (PEP 562) from
:func:`exports`::

    __getattr__ = _lazy.exports(__name__, {"Name": "trainguard.pkg.module"})

The face keeps its ``__all__`` and, under ``TYPE_CHECKING``, the same imports written out, so
type checkers and readers see the names where they live.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, homes: Mapping[str, str], *, before: Callable[[str], None] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``homes`` (name ->
    the module it lives in) from its module at each access, after calling ``before(name)``
    (a check that must precede the import, such as the torch version's); any other name is an
    ``AttributeError``, as for a module without one."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if before is not None:
            before(name)
        return getattr(importlib.import_module(home), name)

    return __getattr__
