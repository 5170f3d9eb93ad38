"""Immutable round state passed to hooks, and the restart interrupt."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Mapping
from types import FrameType, MappingProxyType
from typing import Literal

from trainguard.restart._records import RoundLayout

__all__ = ["RestartInterrupt", "RoundOutcome", "RoundState", "describe"]

#: how a round ended: every active rank returned, a fault (restart), the job ends, or a
#: newcomer asked to be admitted (a restart like a fault, never counted as one).
Why = Literal["fault", "complete", "end", "admit"]


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

    @classmethod
    def of_layout(
        cls, ready: RoundLayout, initial_rank: int, initial_world_size: int
    ) -> RoundState:
        """Initial rank ``initial_rank``'s state in the published round layout ``ready``."""
        active = tuple(ready.active)
        return cls(
            round=ready.round,
            initial_rank=initial_rank,
            initial_world_size=initial_world_size,
            rank=active.index(initial_rank) if initial_rank in active else None,
            world_size=len(active),
            active_ranks=active,
            spare_ranks=tuple(ready.spare),
            gone=ready.gone,
            faults=ready.faults,
        )

    def replace(self, **changes: object) -> RoundState:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """How round ``n`` ended: the value of the round's stop key in the store.

    Any rank (or a sidecar writing a death notice) proposes an outcome with ``compare_set``
    (:func:`trainguard.restart._book.propose`, its one writer); the first proposal wins and
    every rank's monitor acts on it (:mod:`.monitor`). Built with :meth:`fault`, :meth:`end`
    or :meth:`complete`; stored as JSON by :meth:`encode` (unset fields left out) and read
    back by :meth:`decode`.

    Attributes:
        why: ``"complete"`` (every active rank returned), ``"fault"`` (restart the round),
            ``"end"`` (the job ends: a rank left with an error, a wait timed out...) or
            ``"admit"`` (a newcomer waits at the next barrier: restart so that it joins; not
            a fault, never counted by ``max_repeated_faults``).
        rank: the initial rank that faulted, ended the job or asks to be admitted (None when
            no rank did).
        reason: why the job ended (``end``).
        error: one-line description of the exception (see :func:`describe`) or of the fault.
        type: the fault's kind: the exception's type name, ``Hang``, ``SidecarLost``,
            ``RankGone``.
        time: wall-clock time (``time.time()``) of the fault.
    """

    why: Why
    rank: int | None = None
    reason: str | None = None
    error: str | None = None
    type: str | None = None
    time: float | None = None

    @classmethod
    def fault(cls, rank: int, error: str, kind: str) -> RoundOutcome:
        """Rank ``rank`` faulted (``error``, of kind ``kind``): the round restarts."""
        return cls("fault", rank=rank, error=error, type=kind, time=time.time())

    @classmethod
    def end(cls, reason: str, *, rank: int | None = None, error: str | None = None) -> RoundOutcome:
        """The job ends for ``reason`` (caused by ``rank``, when a rank did)."""
        return cls("end", rank=rank, reason=reason, error=error)

    @classmethod
    def admit(cls, rank: int) -> RoundOutcome:
        """Initial rank ``rank`` came back (a respawned process) and waits at the next
        barrier: the round restarts so that it is laid out with the others."""
        return cls("admit", rank=rank, time=time.time())

    @classmethod
    def complete(cls) -> RoundOutcome:
        """Every active rank's function returned."""
        return cls("complete")

    def encode(self) -> bytes:
        """Compact JSON of the fields that are set (what the stop key holds)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> RoundOutcome:
        """Inverse of :meth:`encode`; never raises.

        A value that is not a valid outcome (not JSON, an unknown ``why``, a field of the wrong
        type) decodes to an ``end`` outcome whose reason quotes it: a monitor must never crash
        on what it reads, and a round whose outcome nobody can read cannot be restarted safely.
        Unknown fields are ignored.
        """
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            value = None
        problem = _invalid(value)
        if problem is not None:
            text = raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")
            return cls.end(f"unreadable round outcome in the store ({problem}): {text[:200]!r}")
        return cls(**{name: value.get(name) for name in _OUTCOME_FIELDS})


_OUTCOME_FIELDS = tuple(f.name for f in dataclasses.fields(RoundOutcome))  # read once per rank

_OUTCOME_TYPES: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "reason": (str,),
    "error": (str,),
    "type": (str,),
    "time": (int, float),
}


def _invalid(value: object) -> str | None:
    """What makes ``value`` (decoded JSON) not an outcome; None when it is one."""
    if not isinstance(value, dict):
        return "not a JSON object"
    if value.get("why") not in ("fault", "complete", "end", "admit"):
        return f"why={value.get('why')!r}"
    for name, types in _OUTCOME_TYPES.items():
        field = value.get(name)
        if field is not None and (isinstance(field, bool) or not isinstance(field, types)):
            return f"{name}={field!r}"
    return None


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
