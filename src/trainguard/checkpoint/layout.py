"""Flatten a nested state dict into file entries plus a JSON skeleton, and build it back.

The public face of :mod:`.format.layout`, where the skeleton's shape is described: the same
names, re-exported.
"""

from __future__ import annotations

from trainguard.checkpoint.format.layout import (
    Entry,
    Flat,
    dtype_from_name,
    dtype_name,
    flatten,
    largest_leaf,
    tensor_entry,
    unflatten,
)

__all__ = [
    "Entry",
    "Flat",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "largest_leaf",
    "tensor_entry",
    "unflatten",
]
