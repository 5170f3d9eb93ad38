"""Measurement: each step's time and named sections' times, on the thread that trains.

The wrapper makes one :class:`Timer` per round on each active rank and makes it current
(:func:`use`); ``call.ping()`` ends a step (:meth:`Timer.step`) and :class:`Section` (``with
call.section("forward"):``, ``with trainguard.stragglers.section("forward"):`` or
``@trainguard.stragglers.section("forward")``) times a block. The training thread pays two
``perf_counter()`` reads and one ``deque.append`` per section or step; when CUDA is in use,
two recorded CUDA events per section too, resolved later by the detector's thread (never a
synchronisation in the loop). With no timer current (detection off, a spare, outside a
wrapped call) a section costs one global read.

Samples are kept per name in bounded deques (the last ``window`` values); the detector's
thread reads them (:meth:`Timer.medians`). Names ending in ``@gpu`` hold CUDA event times.
"""

from __future__ import annotations

import collections
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from trainguard.errors import ConfigError

__all__ = ["STEP", "Section", "Timer", "section"]

STEP = "step"  #: the name of the step time (one ``call.ping()`` to the next)
GPU = "@gpu"  #: suffix of the names whose samples are CUDA event times

F = TypeVar("F", bound=Callable[..., Any])

_current: Timer | None = None


def _cuda_in_use() -> bool:
    """CUDA is present and this process already uses it (never imports torch or starts CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:  # a broken driver: CPU times only
        return False


class Timer:
    """One round's samples on one rank (see the module docstring).

    Args:
        window: how many recent samples to keep per name.
        every: a window ends every ``every`` steps; ``on_window(k)`` is then called with the
            window's number (1, 2, ...) on the training thread: it must be cheap.
        cuda: also time sections with CUDA events (None: when CUDA is in use).
    """

    def __init__(
        self,
        *,
        window: int,
        every: int,
        on_window: Callable[[int], None] | None = None,
        cuda: bool | None = None,
    ) -> None:
        self.window = window
        self.every = every
        self.on_window = on_window
        self.cuda = _cuda_in_use() if cuda is None else cuda
        self.samples: dict[str, collections.deque[float]] = {}
        self.pending: collections.deque[tuple[str, Any, Any]] = collections.deque(maxlen=4 * window)
        self.steps = 0
        self._last: float | None = None

    def add(self, name: str, seconds: float) -> None:
        """Record one sample of ``name`` (a section's or a step's time)."""
        samples = self.samples.get(name)
        if samples is None:
            samples = self.samples[name] = collections.deque(maxlen=self.window)
        samples.append(seconds)

    def step(self) -> None:
        """End a step (``call.ping()``): its time is the time since the previous one."""
        now = time.perf_counter()
        if self._last is not None:
            self.add(STEP, now - self._last)
        self._last = now
        self.steps += 1
        if self.steps % self.every == 0 and self.on_window is not None:
            self.on_window(self.steps // self.every)

    def resolve_gpu(self) -> None:
        """Turn the CUDA event pairs that completed into ``NAME@gpu`` samples (not on the
        training thread: it reads the events' state, it never waits for them)."""
        while self.pending:
            name, start, end = self.pending[0]
            if not end.query():
                return
            self.pending.popleft()
            self.add(name + GPU, start.elapsed_time(end) / 1000.0)

    def medians(self) -> dict[str, float]:
        """Each name's median over its kept samples."""
        if self.cuda:
            self.resolve_gpu()
        out = {}
        for name, samples in list(self.samples.items()):
            values = list(samples)
            if values:
                out[name] = statistics.median(values)
        return out


class Section:
    """Times a block (``with``) or each call of a function (decorator) under ``name``.

    Not reentrant: use a new one per block (``section(name)`` and ``call.section(name)``
    make one each time).
    """

    __slots__ = ("_events", "_start", "_timer", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._timer: Timer | None = None
        self._start = 0.0
        self._events: Any = None

    def __enter__(self) -> Section:
        timer = self._timer = _current
        if timer is not None:
            if timer.cuda:
                import torch

                self._events = torch.cuda.Event(enable_timing=True)
                self._events.record()
            self._start = time.perf_counter()
        return self

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        timer = self._timer
        if timer is None or kind is not None:
            return
        timer.add(self.name, time.perf_counter() - self._start)
        if self._events is not None:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timer.pending.append((self.name, self._events, end))
            self._events = None

    def __call__(self, fn: F) -> F:
        name = self.name

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with Section(name):
                return fn(*args, **kwargs)

        return timed  # type: ignore[return-value]


def section(name: str) -> Section:
    """A timed section named ``name``: ``with section("forward"): ...`` or as a decorator.

    Samples go to the current round's timer (straggler detection on, in a wrapped call, on
    an active rank); otherwise the section does nothing.
    """
    if not isinstance(name, str) or not name or name == STEP or name.endswith(GPU):
        raise ConfigError(
            f"section name {name!r}: pass a non-empty string other than {STEP!r} that does "
            f"not end in {GPU!r}"
        )
    return Section(name)


def use(timer: Timer | None) -> None:
    """Make ``timer`` the one that sections record into (None: none)."""
    global _current
    _current = timer
