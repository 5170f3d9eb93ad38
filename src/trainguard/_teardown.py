"""How a restart round's own resources end: its checkpointers, then its process group.

Shared by the demo, the framework integrations (their ``release_round``) and the soak.
"""

from __future__ import annotations

import contextlib
from typing import Any


def close_round(resources: list[Any], *, strict: bool) -> None:
    """Close a round's checkpointers (last opened first) and its process group.

    After a fault (not ``strict``) errors of closing are expected and ignored, and a pending
    disk commit is abandoned (it may wait for a dead rank); with ``strict`` the first error
    is raised.
    """
    import torch.distributed as dist

    from trainguard.checkpoint.async_save import AsyncCheckpointer

    errors = []
    for resource in reversed(resources):
        try:
            if not strict and isinstance(resource, AsyncCheckpointer):
                resource.close(abandon=True)
            else:
                resource.close()
        except Exception as exc:
            errors.append(exc)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if strict and errors:
        raise errors[0]
