"""Typed settings read from Flower's run config (``[tool.flwr.app.config]`` + ``--run-config``).

Run-config keys are the field names with ``-`` for ``_`` (``data-seed`` -> ``data_seed``).
:func:`from_run_config` fills a frozen dataclass, checks each value's type against the field's
default, and leaves unknown keys to the caller (the ServerApp rejects keys nobody reads).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A run-config value that is missing, of the wrong type or out of range."""


def key_of(field_name: str) -> str:
    return field_name.replace("_", "-")


def from_run_config(cls: type[T], run_config: Mapping[str, Any]) -> T:
    """Build dataclass ``cls`` from the run-config keys it knows; defaults fill the rest."""
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = key_of(f.name)
        if key not in run_config:
            continue
        default = f.default
        value = run_config[key]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(
                f"run config '{key}' = {value!r}: expected {type(default).__name__} "
                f"(like the default {default!r})"
            )
        values[f.name] = value
    return cls(**values)


def known_keys(cls: type) -> set[str]:
    return {key_of(f.name) for f in dataclasses.fields(cls)}


def as_run_config(obj: Any) -> dict[str, Any]:
    return {key_of(k): v for k, v in dataclasses.asdict(obj).items()}


def check(condition: bool, key: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"run config '{key}' = {value!r} is out of range: {allowed}")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (a misspelling's likely target), or None."""
    names = sorted(set(known))
    if name in names:
        return None
    found = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """`` (did you mean 'bernoulli'?)`` when the name of spec ``value`` (before its first ``:``) is
    none of the ``known`` names but close to one; else ``""``. The one place a misspelt name of a
    spec (schedule, strategy, model, ...) gets its suggestion: the run config's checks, the drop-in's
    arguments and the registries' own errors all use it."""
    name = str(value).strip().partition(":")[0].strip().lower()
    near = closest(name, known) if name else None
    return f" (did you mean '{near}'?)" if near else ""


def key_error(key: str, value: Any, err: Exception, known: Iterable[str] = ()) -> ConfigError:
    """A ConfigError naming the run-config ``key`` whose ``value`` ``err`` is about, with the
    closest of the ``known`` names when the value's name is none of them (unless ``err`` has it)."""
    hint = "" if "did you mean" in str(err) else did_you_mean(value, known)
    return ConfigError(f"run config '{key}' = {value!r}: {err}{hint}")


@contextmanager
def config_key(key: str, value: Any, known: Iterable[str] = ()) -> Iterator[None]:
    """Turn a ValueError raised while building what ``key`` names (a SpecError, an ExtensionError, a
    ScheduleError, ...) into a ConfigError naming the key (:func:`key_error`); a ConfigError passes."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise key_error(key, value, err, known) from err
