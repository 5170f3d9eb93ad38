"""The CallWrapper: what the wrapped function receives about its round, and its two calls.

The Wrapper builds one :class:`CallWrapper` per round on each active rank and passes it to
the function through the parameter annotated ``CallWrapper`` (:func:`call_param`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from trainguard import _progress
from trainguard.coord.store import StoreLike, connect, parse_addr
from trainguard.errors import NonFiniteError
from trainguard.restart._preconnect import claim
from trainguard.restart.monitor import Monitor
from trainguard.restart.preempt import Preemption
from trainguard.restart.state import RoundState
from trainguard.stragglers.round import Section, Timer, section

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["CallWrapper", "call_param"]


class CallWrapper:
    """Handed to the wrapped function (declare a parameter annotated ``CallWrapper``).

    Attributes (read them, do not set them):
        round: the restart round, 0 first.
        rank: this rank's rank in the round (the function runs on active ranks only).
        world_size: the number of active ranks in the round.
        initial_rank, initial_world_size: this process's rank and the world size at launch.
        state: the full :class:`RoundState`.
    """

    def __init__(
        self,
        state: RoundState,
        monitor: Monitor,
        pg_addr: str,
        timeout: float,
        timer: Timer | None = None,
        preemption: Preemption | None = None,
    ):
        self.state = state
        self.round = state.round
        self.world_size = state.world_size
        self.initial_rank = state.initial_rank
        self.initial_world_size = state.initial_world_size
        self._monitor = monitor
        self._pg_addr = pg_addr
        self._timeout = timeout
        self._store: StoreLike | None = None
        self.pings = 0
        self.last_ping = time.monotonic()
        self._timer = timer
        self._preemption = preemption

    @property
    def rank(self) -> int:
        """This rank's rank in the round (the function runs on active ranks only)."""
        assert self.state.rank is not None
        return self.state.rank

    @property
    def store(self) -> Store:
        """A client of this round's own store (fresh each round; dropped when it ends): a
        ``torch.distributed.TCPStore``.

        For ``init_process_group(backend, store=call.store, rank=call.rank,
        world_size=call.world_size)``.
        """
        if self._store is None:
            host, port = parse_addr(self._pg_addr)
            # connected ahead of time when a plain init_process_group did not take it
            store = claim(host, port, self._timeout)
            self._store = store if store is not None else connect(host, port, timeout=self._timeout)
        return cast("Store", self._store)  # a rank's clients are torch's (see StoreLike)

    def ping(self) -> None:
        """Report progress (cheap: a counter and a clock read).

        The watchdog thread reads the pings: once the function has pinged, a round without a
        ping for ``soft_timeout`` is a hang even when the main thread's position keeps moving
        (a loop in Python code), and the round is aborted and restarted. A ping is also
        progress: rounds that keep failing the same way count as repeats only when nothing
        pinged (or saved a checkpoint) between them (``max_repeated_faults``). With
        ``Wrapper(stragglers=...)`` a ping also ends a step: its time is a sample.
        """
        self.pings += 1
        self.last_ping = time.monotonic()
        _progress.mark()
        if self._timer is not None:
            self._timer.step()

    def section(self, name: str) -> Section:
        """A named, timed block for straggler detection: ``with call.section("forward"):``.

        With ``Wrapper(stragglers=...)`` its CPU wall time (and CUDA event time when CUDA is
        in use) goes into this rank's scores; otherwise it does nothing. Also usable as
        ``trainguard.stragglers.section(name)``, a context manager or decorator.
        """
        return section(name)

    def preempted(self, step: int) -> bool:
        """Whether the job stops here for a preemption (SIGTERM): call it at every step
        boundary, on every active rank, with the number of steps completed.

        True on every rank at the same ``step`` once any rank of the job got SIGTERM (the
        first to notice proposes the next boundary; the others read it from the coordination
        store, where it outlives the round: one round trip per call). Then save the state of
        ``step`` completed steps (local and durable), wait for the saves within
        :meth:`grace_left` and return: the wrapped function then raises
        :class:`~trainguard.restart.Preempted` (exit status 75) and the next start resumes
        from that step. Protocol: :mod:`trainguard.restart.preempt`.
        """
        if self._preemption is None:
            return False
        return self._preemption.check(step, self.state)

    def grace_left(self) -> float | None:
        """Seconds left of the preemption budget (``Wrapper(preemption_grace=...)``), for the
        waits on the preemption checkpoint; None while this process got no SIGTERM."""
        return self._preemption.grace_left() if self._preemption is not None else None

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A block that a restart never interrupts: the abort waits until it ends.

        Keep it short, and never wait on other ranks inside it (their fault would leave this
        rank waiting with nothing to release it).
        """
        return self._monitor.atomic()

    def check_finite(self, *values: Any, what: str = "loss") -> None:
        """Raise :class:`~trainguard.errors.NonFiniteError` if any of ``values`` (tensors,
        numbers, or iterables of parameters, whose ``.grad`` is checked) holds a NaN or an
        infinity on this rank: call it on every active rank, e.g. on the local loss before
        ``backward()``, or on ``model.parameters()`` before the gradients' all-reduce.

        Local only (no collective): the fault is this rank's, attributed to its host like any
        other and recovered by a restart, before the numbers spread to every rank. When every
        host raises it at the same place, it is the model's numbers, not a bad node: the
        quarantine counts it against no host (:mod:`trainguard.restart.quarantine`).
        """
        bad = _non_finite(values)
        if bad:
            raise NonFiniteError(
                f"rank {self.rank} (initial {self.initial_rank}): non-finite {what} in "
                f"round {self.round}: {bad}"
            )

    def _close(self) -> None:
        self._store = None


def _non_finite(values: tuple[Any, ...]) -> str:
    """A description of the first non-finite value among ``values``, "" when all are finite."""
    import torch

    for i, value in enumerate(values):
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                return f"value {i} is {value}"
        elif isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return f"value {i}: {int((~torch.isfinite(value)).sum())} non-finite entries"
        else:
            for j, p in enumerate(value):
                grad = getattr(p, "grad", None)
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    return f"value {i}: the gradient of parameter {j} is not finite"
    return ""


def call_param(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s parameter annotated ``CallWrapper``, if it has one."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for name, param in inspect.signature(fn).parameters.items():
        ann = hints.get(name, param.annotation)
        if ann is CallWrapper or (isinstance(ann, str) and ann.split(".")[-1] == "CallWrapper"):
            return name
    return None
