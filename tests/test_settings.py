"""One settings mechanism (``trainguard._settings``) for the Wrapper, both checkpointers and the
launcher: frozen keyword-only dataclasses whose converted fields are checked as they are set."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest

from trainguard._settings import Converted, Seconds, _raw, chosen, signature
from trainguard.checkpoint import AsyncOptions
from trainguard.checkpoint.local import LocalOptions
from trainguard.errors import ConfigError
from trainguard.launch import LaunchOptions
from trainguard.restart import WrapperConfig

ALL = (WrapperConfig, AsyncOptions, LocalOptions, LaunchOptions)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_settings_class_is_built_one_way(cls: type) -> None:
    params = dataclasses.fields(cls)
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert all(f.kw_only for f in params if f.init)
    with pytest.raises(TypeError):
        cls(None)  # keyword-only
    built = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.__setattr__(params[0].name, None)
    # each timeout is a Seconds field: assigned a timedelta, read back as float seconds
    timeouts = [f.name for f in params if f.name.endswith(("_timeout", "_interval"))]
    assert timeouts, cls
    for name in timeouts:
        assert isinstance(_raw(cls, name), Seconds), f"{cls.__name__}.{name} is not Seconds"
        value = getattr(cls(**{name: timedelta(seconds=getattr(built, name))}), name)
        assert type(value) is float and value == getattr(built, name)
        with pytest.raises(ConfigError, match=rf"^{name}=-1: must be a positive"):
            cls(**{name: -1})
    # the read-back values convert again to the same object (dataclasses.replace)
    assert dataclasses.replace(built) == built
    # and a caller reads the types it writes
    shown = {p.name: p.annotation for p in signature(cls).parameters.values()}
    assert all(shown[name] == "float | datetime.timedelta" for name in timeouts)


def test_a_converted_field_names_itself_in_its_error_and_reads_back_converted() -> None:
    def upper(name: str, value: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r}: give a str")
        return value.upper()

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Options:
        mode: Converted[str, str] = Converted("fast", upper)
        wait: Seconds = Seconds(timedelta(minutes=1))

    assert (Options().mode, Options().wait) == ("FAST", 60.0)
    assert Options(mode="slow", wait=2).mode == "SLOW"
    with pytest.raises(ConfigError, match=r"^mode=3: give a str"):
        Options(mode=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^wait='1': give seconds"):
        Options(wait="1")  # type: ignore[arg-type]
    assert str(inspect.signature(Options)) != str(signature(Options))  # the written type


def test_options_or_keywords_but_not_both() -> None:
    given = AsyncOptions(commit_timeout=5)
    assert chosen(None, AsyncOptions(fsync=False), "X").fsync is False
    assert chosen(given, AsyncOptions(), "X") is given
    with pytest.raises(ConfigError, match="pass them one way"):
        chosen(given, AsyncOptions(fsync=False), "AsyncCheckpointer")
    with pytest.raises(ConfigError, match="pass a AsyncOptions"):
        chosen(LocalOptions(), AsyncOptions(), "AsyncCheckpointer")
