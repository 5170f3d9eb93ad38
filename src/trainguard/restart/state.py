"""Immutable round state passed to hooks, and the restart interrupt."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Mapping
from types import FrameType, MappingProxyType

__all__ = ["RestartInterrupt", "RoundState", "describe"]


@dataclasses.dataclass(frozen=True)
class RoundState:
    """What one rank knows about a restart round (immutable).

    Hooks (``initialize``, ``finalize``, ``health_check``, ``abort``) receive it.

    Attributes:
        round: the restart round, 0 first.
        initial_rank, initial_world_size: this process's rank and the world size at launch.
        rank: this rank's rank in the round; None while it is a spare (or before assignment).
        world_size: the number of active ranks in the round.
        active_ranks: initial ranks of the active ranks, index = rank in the round.
        spare_ranks: initial ranks that wait idle this round.
        gone: initial ranks that have left the job -> why.
        faults: faults of this round so far, initial rank -> description.
    """

    round: int
    initial_rank: int
    initial_world_size: int
    rank: int | None = None
    world_size: int = 0
    active_ranks: tuple[int, ...] = ()
    spare_ranks: tuple[int, ...] = ()
    gone: Mapping[int, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    faults: Mapping[int, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        for name in ("gone", "faults"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))
        object.__setattr__(self, "active_ranks", tuple(self.active_ranks))
        object.__setattr__(self, "spare_ranks", tuple(self.spare_ranks))

    @property
    def active(self) -> bool:
        """True when this rank runs the function in this round."""
        return self.rank is not None

    def replace(self, **changes: object) -> RoundState:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class RestartInterrupt(BaseException):
    """Raised asynchronously in the main thread to unwind the function when a round aborts.

    A ``BaseException`` so that the function's ``except Exception`` blocks let it through; its
    ``finally`` and ``with`` blocks run. Catching it in the function is a mistake that the
    wrapper reports with the place where it was swallowed. Only the wrapper raises it.
    """

    #: the instance most recently raised in this process (kept to report a swallowed one).
    last: RestartInterrupt | None = None

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        frame = sys._getframe(1)
        self.raised_at = _where(frame)
        RestartInterrupt.last = self

    def swallowed_at(self) -> str:
        """Where the exception stopped propagating: the outermost frame it reached."""
        tb = self.__traceback__
        if tb is None:
            return self.raised_at
        return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe(exc: BaseException, *, limit: int = 3) -> str:
    """``Type: message (file:line in fn <- ...)``: a one-line summary of a fault."""
    text = f"{type(exc).__qualname__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)[-limit:]
    if frames:
        where = " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames))
        text += f" ({where})"
    return text[:2000]
