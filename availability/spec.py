"""The spec grammar shared by every pluggable choice: ``name:key=value,key=value``.

Examples: ``always``, ``bernoulli:p=0.5``, ``sine:gamma=0.3,period=20``,
``dirichlet:alpha=0.1``. A user's object is named ``module:attr[:key=value,...]``
(``mypkg.lr:warmup:rounds=5``, :mod:`runconfig.extensions`): the grammar reads it as a Spec whose
name is ``module:attr`` (case kept); the caller imports it. Values are parsed as int, float or bool when they look like one,
and stay strings otherwise (paths, names). Keys are documented in kebab-case
(``min-size``); the snake_case spelling (``min_size``) names the same key. Numpy- and Flower-free on purpose: the
availability models, the partitioners and the run config all read the same grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from runconfig.extensions import ExtensionError, split_reference

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_KEY = re.compile(r"^[a-z][a-z0-9_\-]*$")


class SpecError(ValueError):
    """A spec string that cannot be parsed or does not fit what it names."""


@dataclass(frozen=True)
class Spec:
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params.items())

    def take(self, allowed: dict[str, Any], *, what: str = "spec") -> dict[str, Any]:
        """Return ``allowed`` (name -> default) updated by this spec's params.

        Unknown keys raise a SpecError naming the allowed ones; a default's type is
        enforced (an int default accepts ints only, a float default ints or floats). Keys are
        written in kebab-case (``min-size``); snake_case (``min_size``) is accepted: a key
        matches whichever spelling ``allowed`` uses.
        """
        by_key = {canonical_key(k): k for k in allowed}
        unknown = sorted(k for k in self.params if canonical_key(k) not in by_key)
        if unknown:
            raise SpecError(
                f"{what} '{self.name}': unknown parameter(s) {unknown}; "
                f"allowed: {sorted(k.replace('_', '-') for k in allowed) or 'none'}"
            )
        out = dict(allowed)
        seen: dict[str, str] = {}
        for key, value in self.params.items():
            real = by_key[canonical_key(key)]
            if real in seen:
                raise SpecError(f"{what} '{self.name}': parameter {real!r} given twice "
                                f"({seen[real]!r} and {key!r})")
            seen[real] = key
            out[real] = _coerce_like(allowed[real], value, f"{what} '{self.name}', parameter '{key}'")
        return out


def canonical_key(key: str) -> str:
    """The one spelling two spec keys are compared in: ``min-size`` and ``min_size`` are the same key."""
    return key.strip().lower().replace("-", "_")


def parse_params(text: str, *, what: str = "spec") -> dict[str, Any]:
    """The ``key=value,...`` part of a spec alone (after a ``module:attr`` name); {} for ""."""
    if not text.strip():
        return {}
    try:
        return parse_spec("x:" + text).params
    except SpecError as err:
        raise SpecError(f"{what}: parameters {text!r}: {str(err).split(': ', 1)[-1]}") from err


def _coerce_like(default: Any, value: Any, where: str) -> Any:
    if default is None or isinstance(default, str):
        return value if default is None else str(value)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise SpecError(f"{where}: expected true/false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(f"{where}: expected an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SpecError(f"{where}: expected a number, got {value!r}")
    return value


def parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_spec(text: str) -> Spec:
    """Parse ``name:key=value,...`` into a Spec; raise SpecError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"empty spec {text!r}; expected 'name' or 'name:key=value,...'")
    name, sep, rest = text.strip().partition(":")
    name = name.strip().lower()
    if not _NAME.match(name):
        try:
            reference = split_reference(text)
        except ExtensionError as err:
            raise SpecError(str(err)) from err
        if reference is None:
            raise SpecError(f"spec {text!r}: bad name {name!r}; expected letters, digits, '-', '_', or a "
                            "Python object as 'module:attr[:key=value,...]'")
        return Spec(reference[0], parse_params(reference[1], what=f"spec {text!r}"))
    params: dict[str, Any] = {}
    if sep:
        if not rest.strip():
            raise SpecError(f"spec {text!r}: nothing after ':'; expected key=value,...")
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not eq or not key or not value:
                raise SpecError(f"spec {text!r}: item {item.strip()!r} is not key=value")
            if not _KEY.match(key):
                raise SpecError(f"spec {text!r}: bad key {key!r}")
            if key in params:
                raise SpecError(f"spec {text!r}: key {key!r} given twice")
            params[key] = parse_value(value)
    return Spec(name, params)
