"""Swap two directory entries in one step: ``renameat2(RENAME_EXCHANGE)``.

Linux (3.15 and later) exchanges two names atomically: at every instant each name exists and
names one of the two directories, so a reader that opens the name finds one of them whole.
:func:`exchange` calls it through libc's ``renameat2`` (glibc 2.28 and later), or the raw
system call where libc lacks the wrapper. It raises :class:`OSError` with the errno the kernel
gives: ``EINVAL`` where a file system cannot exchange (some network and FUSE file systems),
``ENOSYS`` on a kernel or platform without it; :func:`refused` says which errors mean "use
two renames instead".
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Any

__all__ = ["exchange", "refused"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: ``renameat2``'s system call number where libc has no wrapper.
_SYSCALLS = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
_REFUSED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}

_call: Any = None


def _function() -> Any:
    """The call: ``(olddirfd, old, newdirfd, new, flags) -> int``; None where there is none."""
    global _call
    if _call is None:
        _call = False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
        wrapper = getattr(libc, "renameat2", None)
        number = _SYSCALLS.get(platform.machine())
        if wrapper is not None:
            _call = wrapper
        elif number is not None and hasattr(libc, "syscall"):
            syscall = libc.syscall
            _call = lambda *args: syscall(number, *args)  # noqa: E731
    return _call or None


def exchange(a: str, b: str) -> None:
    """Exchange the directory entries ``a`` and ``b`` (both must exist) atomically."""
    call = _function()
    if call is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here", a)
    result = call(
        ctypes.c_int(_AT_FDCWD),
        os.fsencode(a),
        ctypes.c_int(_AT_FDCWD),
        os.fsencode(b),
        ctypes.c_uint(_RENAME_EXCHANGE),
    )
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a, None, b)


def refused(exc: OSError) -> bool:
    """Whether :func:`exchange` failed because the system cannot exchange (not because a name
    is missing or the disk failed): then two renames must do."""
    return exc.errno in _REFUSED
