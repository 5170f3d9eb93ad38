"""A storage layer under test: torch's ``FileSystemWriter``/``FileSystemReader`` or trainguard's
``StorageWriter``/``StorageReader``, with the conversions to and from ``torch.save`` files that
go with each. A :class:`Layer` closes every writer it made."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils

from trainguard.checkpoint.dcp import (
    StorageReader,
    StorageWriter,
    dcp_to_torch_save,
    torch_save_to_dcp,
)

LAYERS = ("torch", "trainguard")


class Layer:
    """One storage layer by name (one of :data:`LAYERS`)."""

    def __init__(self, name: str) -> None:
        assert name in LAYERS, name
        self.name = name
        self._writers: list[StorageWriter] = []

    def writer(self, path: str | os.PathLike[str], **kwargs: Any) -> Any:
        """A storage writer for ``path`` (``overwrite=`` as both layers take it)."""
        if self.name == "torch":
            return dcp.FileSystemWriter(os.fspath(path), **kwargs)
        writer = StorageWriter(path, **kwargs)
        self._writers.append(writer)
        return writer

    def reader(self, path: str | os.PathLike[str], *, trusted: bool = False) -> Any:
        """A storage reader for ``path``; ``trusted``: unpickle any saved object (torch's
        reader always does; trainguard's only with ``allow_pickle``)."""
        if self.name == "torch":
            return dcp.FileSystemReader(os.fspath(path))
        return StorageReader(path, allow_pickle=trusted)

    def to_torch_save(self, directory: str | os.PathLike[str], file: str) -> None:
        if self.name == "torch":
            format_utils.dcp_to_torch_save(directory, file)
        else:
            dcp_to_torch_save(directory, file)

    def from_torch_save(self, file: str, directory: str | os.PathLike[str]) -> None:
        if self.name == "torch":
            format_utils.torch_save_to_dcp(file, directory)
        else:
            torch_save_to_dcp(file, directory)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def __enter__(self) -> Layer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return self.name
