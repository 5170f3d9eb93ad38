"""The Wrapper decorator, and the protocol of one call of the function it wraps.

Protocol of one call of the wrapped function, on every rank (each rank calls it once, like
any SPMD function):

1. Rank 0 starts the store process; every rank connects to the coordination store and starts
   its monitor thread (:mod:`.monitor`).
2. Round ``n``: health check → barrier of the ranks still in the job → the last arriver lays
   the round out (rank assignment, rank filter, retry controller) → each rank sets RANK,
   WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for the round's own store → ``initialize``
   → active ranks run the function, spares wait.
3. A function that raises records a fault (the round's outcome, first writer wins); every
   rank's monitor interrupts the function and aborts torch.distributed; each rank runs
   ``finalize`` and ``health_check`` and goes to round ``n+1``. A rank whose ``finalize`` or
   ``health_check`` raised leaves the job at that barrier and re-raises the error.
4. When every active rank's function returned, the round is complete: active ranks return
   their function's value, spares return None, and the environment is restored.
5. A SIGTERM (preemption) stops every rank at one agreed step for the function to save, and
   the wrapped function then raises :class:`~trainguard.restart.preempt.Preempted` (exit
   status 75): :mod:`.preempt`.
6. ``KeyboardInterrupt``/``SystemExit`` (any ``BaseException`` that is not ours) ends the job:
   that rank re-raises it, every other rank raises :class:`JobEndedError`.

One call on one rank, and the sequence of one fault, is :mod:`._run`; the function receives
a :class:`~trainguard.restart.call.CallWrapper` (:mod:`.call`); the arguments are a
:class:`~trainguard.restart.config.WrapperConfig`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainguard import _torchcompat
from trainguard.errors import ConfigError
from trainguard.restart._environment import cannot_start
from trainguard.restart._run import WrappedCall
from trainguard.restart.call import CallWrapper, call_param
from trainguard.restart.config import WrapperConfig
from trainguard.restart.config import signature as config_signature

__all__ = ["CallWrapper", "Wrapper"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
S = TypeVar("S")

_active_calls = threading.local()


def _arguments_of(
    config: Callable[P, WrapperConfig],
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """``__init__(self, **kwargs)`` takes ``config``'s keyword arguments: for type checkers
    (``P``) and for ``inspect.signature``/``help`` (``__signature__``)."""

    def give(init: Callable[Concatenate[S, ...], None]) -> Callable[Concatenate[S, P], None]:
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = config_signature().parameters.values()
        init.__signature__ = inspect.Signature([this, *params], return_annotation=None)  # type: ignore[attr-defined]
        return init

    return give


class Wrapper:
    """Decorator: restart the function in-process, on every rank, whenever any rank faults.

    ``Wrapper(**arguments)`` takes the fields of :class:`WrapperConfig` as keyword arguments
    and checks them at once (:attr:`config`); the decorated function, called on every rank,
    runs the protocol of :mod:`trainguard.restart.wrapper`.
    """

    @_arguments_of(WrapperConfig)
    def __init__(self, **kwargs: Any) -> None:
        _torchcompat.check_torch()
        with _before_the_first_round():
            self.config = WrapperConfig(**kwargs)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``fn``; the wrapped function takes ``fn``'s arguments but its CallWrapper."""
        if not callable(fn):
            raise ConfigError(f"Wrapper(...) decorates a function, got {fn!r}")
        param = call_param(fn)
        config = self.config

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _before_the_first_round():
                if param is not None and param in kwargs:
                    raise ConfigError(
                        f"do not pass {param!r}: the Wrapper provides the CallWrapper"
                    )
                if getattr(_active_calls, "on", False):
                    raise ConfigError("a wrapped function cannot call a wrapped function")
                _check_arguments(fn, param, args, kwargs)
                call = WrappedCall(config, fn, param, args, kwargs)  # nothing is set yet
            _active_calls.on = True
            try:
                value = call.run()
            except Exception as exc:
                if call.preemption.signalled:  # the job stops anyway: no error, exit 75
                    logger.error("rank %d: preempted, and: %s", call.launch.rank, exc)
                    raise call.preemption.outcome() from None
                raise
            finally:
                _active_calls.on = False
            if call.preemption.signalled:
                raise call.preemption.outcome()
            return value

        return wrapped


@contextlib.contextmanager
def _before_the_first_round() -> Iterator[None]:
    """A ``ConfigError`` raised here would be raised again by every new start of the process:
    under ``trainguard launch`` the job ends at once (:func:`._environment.cannot_start`)."""
    try:
        yield
    except ConfigError as exc:
        cannot_start(exc)
        raise


def _check_arguments(
    fn: Callable[..., Any], param: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise :class:`ConfigError` at the call when ``fn`` cannot take these arguments (every
    round would fail the same way)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    given = dict(kwargs)
    if param is not None:
        given[param] = None
    try:
        sig.bind(*args, **given)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        how = (
            f"the Wrapper passes the CallWrapper as {param!r}"
            if param is not None
            else "the Wrapper passes a CallWrapper only to a parameter annotated CallWrapper "
            "(def f(call: trainguard.restart.CallWrapper, ...)), and "
            f"{name}{sig} has none"
        )
        raise ConfigError(
            f"{name}{sig} cannot be called with the arguments given ({exc}); {how}. Call the "
            "wrapped function with the arguments it takes, less the CallWrapper"
        ) from exc


# help(Wrapper) documents the arguments with the text written where they are defined.
_, _, _arguments_doc = (WrapperConfig.__doc__ or "").partition("\n")
Wrapper.__doc__ = f"{Wrapper.__doc__ or ''}{_arguments_doc}"
