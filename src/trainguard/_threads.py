"""The loop of a worker thread that serves jobs from a queue until it is handed ``None``."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TypeVar

_J = TypeVar("_J")


def serve(jobs: queue.SimpleQueue[_J | None], handle: Callable[[_J], None]) -> None:
    """Call ``handle`` on each job taken from ``jobs``, in order; return at the ``None`` sentinel.

    ``handle`` is responsible for its own errors: one that escapes ends the thread.
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        handle(job)
