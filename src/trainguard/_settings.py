"""Settings objects, declared, checked and taken one way.

Each settings object of trainguard (:class:`~trainguard.restart.WrapperConfig`,
:class:`~trainguard.checkpoint.AsyncOptions`, :class:`~trainguard.checkpoint.local.LocalOptions`,
:class:`~trainguard.launch.LaunchOptions`) is built the same way:

- a frozen, keyword-only dataclass (``@dataclasses.dataclass(frozen=True, kw_only=True)``):
  immutable once built, every argument named;
- a field whose value is converted on the way in is a :class:`Converted` descriptor: assigned
  what a caller writes (a timeout as seconds or a ``timedelta``), read back as what the
  library uses (float seconds), checked when it is set, with a
  :class:`~trainguard.errors.ConfigError` that names the field and the fix. :class:`Seconds`
  is the timeout field (positive, finite); the converter of any other field is a plain
  function ``(name, value) -> value``, which must accept a value it already converted
  (``dataclasses.replace`` assigns the read-back values again);
- the checks that relate fields (one timeout shorter than another) in ``__post_init__``, which
  runs after every field was converted;
- a constructor that also takes the object's fields as keywords (the checkpointers) takes them
  one way: the keywords or ``options=``, never both (:func:`chosen`).

:func:`signature` writes a settings class's arguments as a caller passes them (for ``help``
and ``inspect.signature`` of a constructor that takes them as keywords).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from trainguard._timeouts import Timeout, seconds
from trainguard.errors import ConfigError

__all__ = ["TIMEOUT", "Converted", "PreemptionGrace", "Seconds", "chosen", "signature"]

In = TypeVar("In")
Out = TypeVar("Out")
_O = TypeVar("_O")

#: a timeout argument's type as a caller writes it
TIMEOUT = f"float | {timedelta.__module__}.{timedelta.__qualname__}"


class Converted(Generic[In, Out]):
    """A field of a settings dataclass: assigned an ``In``, checked and converted by
    ``convert(name, value)`` when it is set (the error names the field), read as an ``Out``.

    ``default`` is what the dataclass's ``__init__`` assigns when the argument is left out
    (converted like any value); ``written``: the type a caller passes, as :func:`signature`
    shows it (None: the annotation's)."""

    def __init__(
        self, default: In, convert: Callable[[str, In], Out], *, written: str | None = None
    ) -> None:
        self._default = default
        self._convert = convert
        self._name = ""
        self.written = written

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: object | None, owner: type | None = None) -> Out:
        if obj is None:  # the class: the dataclass reads the default here
            default: Any = self._default
            return default  # type: ignore[no-any-return]
        value: Out = obj.__dict__[self._name]
        return value

    def __set__(self, obj: object, value: In) -> None:
        obj.__dict__[self._name] = self._convert(self._name, value)


class Seconds(Converted[Timeout, float]):
    """A timeout field: assigned seconds or a ``timedelta`` (positive and finite), read as
    float seconds."""

    def __init__(self, default: Timeout) -> None:
        super().__init__(default, seconds, written=TIMEOUT)


def _grace(name: str, value: Timeout | None) -> float:
    if value is None:
        from trainguard import _env

        value = _env.settings().preemption_grace
    return seconds(name, value)


class PreemptionGrace(Converted[Timeout | None, float]):
    """A ``preemption_grace`` field (the Wrapper's and the launcher's): assigned seconds, a
    ``timedelta`` or None (the ``TRAINGUARD_PREEMPTION_GRACE`` variable, else 60 s), read as
    float seconds."""

    def __init__(self) -> None:
        super().__init__(None, _grace, written=f"{TIMEOUT} | None")


def chosen(given: _O | None, built: _O, what: str) -> _O:
    """The options a constructor uses: ``given`` (its ``options=``), else ``built`` from its
    keywords. Both at once is refused unless every keyword was left at its default."""
    if given is None:
        return built
    if not isinstance(given, type(built)):
        raise ConfigError(f"options={given!r}: pass a {type(built).__name__}")
    if built != type(built)():
        raise ConfigError(
            f"{what} got options= and settings as keywords too: pass them one way (put the "
            f"keywords into the {type(built).__name__}, or leave options= out)"
        )
    return given


def signature(cls: type) -> inspect.Signature:
    """The arguments of the settings dataclass ``cls`` as a caller writes them: a
    :class:`Converted` field's as its ``written`` type (a timeout's ``float |
    datetime.timedelta``)."""
    params = []
    for p in inspect.signature(cls).parameters.values():
        field = _raw(cls, p.name)
        written = field.written if isinstance(field, Converted) else None
        params.append(p.replace(annotation=written) if written else p)
    return inspect.Signature(params, return_annotation=None)


def _raw(cls: type, name: str) -> object:
    """The class attribute ``name`` of ``cls`` or a base, without calling its ``__get__``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None
