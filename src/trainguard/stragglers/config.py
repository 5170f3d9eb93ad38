"""What straggler detection does: :class:`Stragglers` (pass it as ``Wrapper(stragglers=...)``)
and the opt-in policy that acts on it, :class:`TakeOutStragglers`."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from trainguard.coord.store import StoreLike
from trainguard.errors import ConfigError, StragglerError

__all__ = ["Stragglers", "TakeOutStragglers"]


class TakeOutStragglers:
    """Health-check policy: take a rank that stays a straggler out of the job.

    When this rank's relative score was below the threshold for ``windows`` windows in a row,
    its detector claims one of the job's removals (at most ``max_per_hour`` in any hour,
    counted in the coordination store, so the limit holds across ranks and rounds), records a
    fault ``Straggler`` for the round (every rank restarts) and then this policy, called as a
    health check (``RoundState -> None``), raises :class:`~trainguard.errors.StragglerError`
    on that rank: it leaves the job and a spare takes its number at the next round (use
    ``rank_assignment=FillGaps()``, so the other ranks keep theirs). A straggler past the
    limit stays in the job; its ``straggler`` events say so (``action="rate limited"``).

    The Wrapper runs it after the ``health_check`` you pass; give it through
    ``Stragglers(take_out=...)`` only.
    """

    def __init__(self, *, windows: int = 5, max_per_hour: int = 1) -> None:
        for name, value in (("windows", windows), ("max_per_hour", max_per_hour)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"TakeOutStragglers({name}={value!r}): pass an int >= 1")
        self.windows = windows
        self.max_per_hour = max_per_hour
        self.verdict: str | None = None  # set on the rank that is taken out

    def __call__(self, state: Any) -> None:
        verdict, self.verdict = self.verdict, None
        if verdict is not None:
            raise StragglerError(verdict, causes={state.initial_rank: verdict})

    def claim(self, store: StoreLike, prefix: str, who: int, now: float | None = None) -> bool:
        """Claim one removal in the store under ``prefix``: False past the hourly limit.

        Slots ``prefix/out/0, 1, ...`` hold the times of the removals; slot ``i`` may be
        taken only when slot ``i - max_per_hour`` is an hour old. ``compare_set`` makes each
        slot go to one rank; a rank that loses a slot tries the next one. O(1) store
        operations per claim unless ranks race for the same slot."""
        now = time.time() if now is None else now
        mine = f"{now:.6f}:{who}"
        i = int(store.add(prefix + "outs", 0))
        for _ in range(64):
            if i >= self.max_per_hour:
                held = store.get(f"{prefix}out/{i - self.max_per_hour}").decode()
                if now - float(held.split(":")[0]) < 3600.0:
                    return False
            got = store.compare_set(f"{prefix}out/{i}", "", mine)
            if (got.decode() if isinstance(got, bytes) else got) == mine:
                store.add(prefix + "outs", 1)
                return True
            i += 1
        return False

    def __repr__(self) -> str:
        return f"TakeOutStragglers(windows={self.windows}, max_per_hour={self.max_per_hour})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stragglers:
    """Straggler detection settings (``Wrapper(stragglers=Stragglers(...))``).

    Measures each active rank's step time (``call.ping()`` to ``call.ping()``) and the named
    sections it opts into (``call.section(name)``); every ``every`` steps each rank publishes
    its median times over the last ``window`` samples to the round's store (one ``append``)
    and reads the previous window's entries (one ``get``): no collective, nothing waits for a
    rank that did not publish. See :mod:`trainguard.stragglers.scores` for the scores.

    Args:
        every: steps per window (scores are computed once per window).
        window: samples per median (default ``every``).
        threshold: a rank whose relative score is below it is a straggler (0 < threshold < 1;
            0.85 names a rank about 18 % slower than the fastest).
        floor: seconds added to both sides of each ratio, so sections of a few microseconds
            do not turn noise into scores.
        take_out: a :class:`TakeOutStragglers` policy, or None to only report.
        cuda: time sections with CUDA events too (None: when this process uses CUDA).
    """

    every: int = 50
    window: int | None = None
    threshold: float = 0.85
    floor: float = 0.0005
    take_out: TakeOutStragglers | None = None
    cuda: bool | None = None

    def __post_init__(self) -> None:
        if type(self.every) is not int or self.every < 1:
            raise ConfigError(f"Stragglers(every={self.every!r}): pass an int >= 1 (steps)")
        window = self.every if self.window is None else self.window
        if type(window) is not int or window < 1:
            raise ConfigError(f"Stragglers(window={self.window!r}): pass an int >= 1 (samples)")
        object.__setattr__(self, "window", window)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:
            raise ConfigError(
                f"Stragglers(threshold={t!r}): pass a number between 0 and 1 (0.85: a rank "
                "about 18 % slower than the fastest is named)"
            )
        f = self.floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
            raise ConfigError(f"Stragglers(floor={f!r}): pass seconds >= 0")
        if self.take_out is not None and not isinstance(self.take_out, TakeOutStragglers):
            raise ConfigError(
                f"Stragglers(take_out={self.take_out!r}): pass TakeOutStragglers(...) or None"
            )
        if self.cuda not in (None, True, False):
            raise ConfigError(f"Stragglers(cuda={self.cuda!r}): pass None, True or False")
