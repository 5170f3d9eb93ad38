"""The checkpoint file format: writing, reading, validating, and the state's layout in it.

A checkpoint file is a safetensors-compatible container with a checksum per tensor; the nested
structure of the state lives as a JSON skeleton in its header. The modules, bottom up:

- :mod:`.kinds`: the kinds of checkpoint file, dtype codes and size limits (no torch);
- :mod:`.tmpfile`: temporary files nobody can plant, the first step of every atomic write;
- :mod:`.validate`: the checks of a header nobody vouches for (no torch);
- :mod:`.write`: placing entries, hashing, encoding the header, durable writes (no torch);
- :mod:`.read`: parsing a header, verifying checksums, loading a file or a buffer;
- :mod:`.shards` and :mod:`.snode`: a DTensor's local chunk and its skeleton node;
- :mod:`.layout`: flattening a state into entries and a skeleton, and building it back
  (:mod:`._unflatten`, with :mod:`._skelbase` shared by both directions).

Users and the rest of trainguard import from these modules (the one path to each name).
This package imports nothing itself, so the torch-free writer process can use its write side.
"""

from __future__ import annotations

__all__: list[str] = []
