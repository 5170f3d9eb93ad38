"""Where trainguard meets torch's version differences and private APIs, listed in one place.

**The supported range.** :data:`FLOOR` is the oldest torch that the compatibility suite
(``make compat``, ``bench/compat.py``) passes on, :data:`NEWEST_TESTED` the newest; both are
measured, not guessed (the table in docs/compat.md). :func:`check_torch` is
called where trainguard first uses torch (the restart wrapper, the checkpoint package, the
launcher): an older torch raises :class:`~trainguard.errors.UnsupportedTorchError` naming the
version needed, a newer one warns once (:class:`~trainguard.errors.UntestedTorchWarning`).

**Torch's parts, wrapped once** (every torch from :data:`FLOOR` on has them):

- :func:`host_store`: libuv's ``TCPStore`` server on a listening socket of ours
  (``master_listen_fd``, bound to one interface); :func:`clone_store`: a new client of a
  store's server (``Store.clone()``).
- :func:`dcp_async_executor`: the executor of the ``dcp.async_save`` a stager serves.
- :func:`has_cuda_backend`: whether a process group runs a CUDA backend (NCCL).
- :func:`connects_in_constructor`: whether a backend connects its ranks in the group's
  constructor (gloo, unless ``TORCH_GLOO_LAZY_INIT``), and :func:`set_group_timeout`, which
  sets a built group's collective timeout (gloo and NCCL).

**Private torch APIs** that trainguard uses; each entry of :data:`PRIVATE_APIS` names the
attribute, where trainguard uses it and what for, and ``tests/test_torchcompat.py`` fails
loudly when a torch release removes one. The private parts of ``torch.distributed.elastic``
that the launcher's agent needs live in :mod:`trainguard.launch._compat` (with their own
contract test, ``tests/launch/test_compat.py``), and trainguard's pure-Python store client
speaks TCPStore's wire protocol (:mod:`trainguard.coord._wire`, ``tests/coord/test_wire.py``).

This module imports torch only inside its functions.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import warnings
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar, cast

from trainguard.errors import UnsupportedTorchError, UntestedTorchWarning

__all__ = [
    "FLOOR",
    "NEWEST_TESTED",
    "PRIVATE_APIS",
    "PrivateApi",
    "check_torch",
    "clone_store",
    "connects_in_constructor",
    "dcp_async_executor",
    "has_cuda_backend",
    "host_store",
    "is_group",
    "is_member",
    "resolve",
    "set_group_timeout",
]


#: the oldest torch release that passes the compatibility suite (also in pyproject.toml)
FLOOR = (2, 13)
#: the newest torch release that the compatibility suite ran on
NEWEST_TESTED = (2, 15)


class PrivateApi(NamedTuple):
    """One private torch attribute trainguard relies on."""

    path: str  # importable module, then attributes: "torch.distributed.distributed_c10d:_world"
    where: str  # the trainguard module that uses it
    why: str


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "torch.distributed.distributed_c10d:_get_default_group",
        "checkpoint._link, restart.abort",
        "the default process group, to find its store and its backends",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_get_default_store",
        "checkpoint._link",
        "the default group's store, for the checkpointers' commit rounds",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_abort_process_group",
        "restart.abort",
        "abort NCCL communicators (releases a rank blocked in a collective)",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_world",
        "restart.abort",
        "pg_map and group_count: forget groups a failed constructor left behind",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_update_default_pg",
        "restart.abort",
        "forget a default group that could not be destroyed",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_new_process_group_helper",
        "restart.abort",
        "wrapped to record the sockets of each process group (the gloo abort)",
    ),
    PrivateApi(
        "torch.distributed:ProcessGroup._get_backend",
        "_torchcompat.has_cuda_backend",
        "whether a group has a CUDA (NCCL) backend",
    ),
    PrivateApi(
        "torch.distributed.rendezvous:_create_c10d_store",
        "restart._preconnect",
        "replaced so init_process_group takes a store client connected ahead of time",
    ),
    PrivateApi(
        "torch.distributed.rendezvous:_torchelastic_use_agent_store",
        "restart._preconnect",
        "whether the rendezvous connects as a client only",
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d:_set_pg_timeout",
        "_torchcompat.set_group_timeout (restart._setup)",
        "give a group built with a bounded connect phase its collective timeout back",
    ),
    PrivateApi(
        "torch:_foreach_copy_",
        "checkpoint.staging",
        "one batched copy of many tensors into the staging buffers",
    ),
    PrivateApi(
        "torch.distributed.checkpoint.state_dict_saver:async_save",
        "_torchcompat.dcp_async_executor (checkpoint.dcp.async_stager)",
        "its frame's local async_checkpointer_type: the executor a stager's stage() serves",
    ),
    PrivateApi(
        "torch._C._distributed_c10d:Store",
        "coord, checkpoint (type annotations only)",
        "the store type (torch.distributed.Store is its public alias)",
    ),
)


def resolve(path: str) -> Any:
    """The object that a :class:`PrivateApi` path names (``module:attr.attr``); raises
    ``ImportError`` or ``AttributeError`` when torch no longer has it."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for name in attrs.split("."):
        obj = getattr(obj, name)
    return obj


# the range ------------------------------------------------------------------------------
_checked = False


def _release(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedTorchError(f"cannot read torch's version {version!r}")
    return int(found.group(1)), int(found.group(2))


def check_torch(version: str | None = None) -> None:
    """Refuse a torch older than :data:`FLOOR`, warn once for one newer than
    :data:`NEWEST_TESTED` (``version``: torch's ``__version__``; for tests)."""
    global _checked
    if version is None:
        if _checked:
            return
        import torch

        version = str(torch.__version__)
        _checked = True
    found = _release(version)
    if found < FLOOR:
        raise UnsupportedTorchError(
            f"trainguard needs torch >= {FLOOR[0]}.{FLOOR[1]}; this is torch {version}: "
            f"pip install 'torch>={FLOOR[0]}.{FLOOR[1]}'"
        )
    if found > NEWEST_TESTED:
        warnings.warn(
            UntestedTorchWarning(
                f"torch {version} is newer than the newest release trainguard was tested with "
                f"({NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}); it relies on torch internals that "
                "may have changed: run `make compat` with it, or install "
                f"'torch<={NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}'"
            ),
            stacklevel=3,
        )


# stores ----------------------------------------------------------------------------------


def host_store(host: str, fd: int, *, timeout: timedelta, multi_tenant: bool = False) -> Any:
    """A ``TCPStore`` server (libuv backend) on the listening socket ``fd`` (from
    :func:`trainguard.coord._bind.listen`; the server owns it from then on), advertised as
    ``host``."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        _port_of(fd),
        is_master=True,
        use_libuv=True,
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        timeout=timeout,
        master_listen_fd=fd,
    )


def _port_of(fd: int) -> int:
    import socket

    with socket.socket(fileno=os.dup(fd)) as sock:
        port: int = sock.getsockname()[1]
    return port


_S = TypeVar("_S")  # a store client


def clone_store(store: _S) -> _S | None:
    """A new client connection to ``store``'s server (``store.clone()``); None for a store
    that cannot be cloned."""
    clone = getattr(store, "clone", None)
    return cast(_S, clone()) if callable(clone) else None  # the same kind of client as store


_ASYNC_SAVE = ("async_save", "torch.distributed.checkpoint.state_dict_saver")
_ASYNC_SAVE_DEPTH = 8  # frames between an AsyncStager.stage and the async_save calling it


def dcp_async_executor() -> str | None:
    """The executor (``"thread"`` or ``"process"``, the value of its
    ``async_checkpointer_type`` argument) of the ``torch.distributed.checkpoint.async_save``
    call that the caller (an ``AsyncStager.stage``) runs under; None outside one. DCP tells a
    stager its executor nowhere else: this reads the argument from the local variables of
    ``async_save``'s frame, at most 8 frames above the caller's."""
    frame = sys._getframe(1).f_back
    for _ in range(_ASYNC_SAVE_DEPTH):
        if frame is None:
            return None
        if (frame.f_code.co_name, frame.f_globals.get("__name__")) == _ASYNC_SAVE:
            kind = frame.f_locals.get("async_checkpointer_type")
            return None if kind is None else str(getattr(kind, "value", kind))
        frame = frame.f_back
    return None


def has_cuda_backend(group: Any) -> bool:
    """Whether process group ``group`` runs a backend for CUDA devices (NCCL)."""
    import torch

    try:
        group._get_backend(torch.device("cuda"))
        return True
    except Exception:
        return False


def connects_in_constructor(backend: Any) -> bool:
    """Whether a group of ``backend`` (as ``init_process_group`` or ``new_group`` name it:
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ``"undefined"``...) connects its ranks in its
    constructor: one with a gloo part, unless gloo's lazy mode is on (``TORCH_GLOO_LAZY_INIT``,
    torch's own variable). NCCL connects at the first collective."""
    import torch.distributed.distributed_c10d as c10d

    if os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip() not in ("", "0"):
        return False
    try:
        backends = c10d.BackendConfig(backend).get_device_backend_map().values()
    except Exception:  # a backend torch does not know: it raises in the constructor itself
        return False
    return any(str(b) == "gloo" for b in backends)


def is_member(ranks: Any) -> bool:
    """Whether this process (its default group's rank) is one of ``ranks``."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_rank() in ranks


def is_group(group: Any) -> bool:
    """Whether ``group`` is a process group (not ``GroupMember.NON_GROUP_MEMBER`` or None)."""
    import torch.distributed as dist

    return isinstance(group, dist.ProcessGroup)


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Set ``group``'s default collective timeout (its gloo and NCCL backends), as if it had
    been built with ``timeout`` (``torch.distributed.distributed_c10d._set_pg_timeout``)."""
    import torch.distributed.distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)
