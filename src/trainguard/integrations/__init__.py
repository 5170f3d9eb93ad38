"""Integrations with training frameworks that own the loop.

- :mod:`trainguard.integrations.lightning` (extra ``trainguard[lightning]``):
  :class:`~trainguard.integrations.lightning.AsyncCheckpointIO`,
  :class:`~trainguard.integrations.lightning.LocalCheckpointCallback` and
  :class:`~trainguard.integrations.lightning.RoundEnvironment` (``trainer.fit`` under the
  in-process restart Wrapper).
- :mod:`trainguard.integrations.transformers` (extra ``trainguard[transformers]``):
  :class:`~trainguard.integrations.transformers.TrainguardCallback` for the Hugging Face
  ``Trainer``, and :func:`~trainguard.integrations.transformers.new_round`.

Import the submodule of the framework you use; importing this package imports no framework.
"""

from __future__ import annotations

__all__: list[str] = []
