"""Strategy names -> classes, and one place to build a strategy from a spec string.

Every module of :mod:`strategies.rules` is imported and every :class:`AvailabilityStrategy`
subclass with a ``name`` is registered, so a new rule is one new module there. A strategy spec
uses the same grammar as schedules: ``fedau:cutoff=50``; its parameters are the rule's own
keyword arguments (its constructors', beyond :class:`StrategyParams`) and the shared sanity bounds
``max-update-norm``, ``max-norm-ratio`` and ``max-weight-share``, type-checked against their
defaults. ``secure=secagg+`` builds the rule's secure variant (:mod:`strategies.secure`, with its
``secure-*`` keys), or raises the rule's reason for refusing it.

A rule that lives outside the project is named like any user object (:mod:`runconfig.extensions`):
``mypkg.rules:MyRule:k=v`` or an entry point of group ``flchurn.strategies``; it must subclass
:class:`AvailabilityStrategy` (any rule class of this package), and its spec parameters are its own
keyword arguments, as for a built-in rule. It runs under its own name (:func:`own_name`: declared,
or from its class name), not its parent's.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from availability.spec import SpecError, parse_spec
from runconfig.extensions import ExtensionError, resolve
from runconfig.fields import did_you_mean

from .base import AvailabilityStrategy
from .contract import Rule
from .params import SPEC_FIELDS, StrategyParams
from .rule_strategy import RuleStrategy
from .secure import secure_class

# the shared parameters a spec may set for every rule (e.g. "mifa:max-norm-ratio=50")
SPEC_SHARED = set(SPEC_FIELDS)
# the other shared parameters come from the run config (build_strategy's ``shared``), not a spec
SHARED = set(StrategyParams.names()) - SPEC_SHARED
T = TypeVar("T")


def _all_subclasses(cls: type[T]) -> list[type[T]]:
    out: list[type[T]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def _collect() -> dict[str, type[AvailabilityStrategy]]:
    for module in pkgutil.iter_modules([str(Path(__file__).parent / "rules")]):
        importlib.import_module(f"{__package__}.rules.{module.name}")
    return {cls.name: cls for cls in _all_subclasses(AvailabilityStrategy) if cls.name}


def is_oracle(cls: type[AvailabilityStrategy]) -> bool:
    """Whether the rule reads the schedule's true probabilities: its rule value declares
    ``needs.oracle``, or (a rule class not yet a value) it, or a class it extends, takes
    ``probabilities`` (a rule's secure variant passes it on)."""
    if issubclass(cls, RuleStrategy) and cls is not RuleStrategy and cls.rule.needs.oracle:
        return True
    return any("probabilities" in inspect.signature(vars(k)["__init__"]).parameters for k in _legacy_classes(cls))


def _legacy_classes(cls: type[AvailabilityStrategy]) -> list[type]:
    """The classes of ``cls``'s MRO whose constructors name spec parameters (rules written as
    subclasses of the adapter; the adapter's own constructors name none)."""
    return [k for k in cls.__mro__ if isinstance(k, type) and issubclass(k, AvailabilityStrategy)
            and k not in (RuleStrategy, AvailabilityStrategy) and "__init__" in vars(k)]


STRATEGIES: dict[str, type[AvailabilityStrategy]] = _collect()
ORACLES = frozenset(n for n, c in STRATEGIES.items() if is_oracle(c))


def strategy_params(cls: type[AvailabilityStrategy], rule: Rule | None = None) -> dict[str, Any]:
    """The rule's own parameters and their defaults (what a spec may set): its rule value's
    ``Params`` fields (``rule``, else the class's), and the keyword arguments of the classes
    that extend it."""
    out = {f.name.replace("_", "-"): f.default for f in fields(StrategyParams) if f.name in SPEC_SHARED}
    if rule is None and issubclass(cls, RuleStrategy) and cls is not RuleStrategy:
        rule = cls.rule
    if rule is not None:
        out.update({k: inspect.Parameter.empty if v is None else v for k, v in rule.param_defaults().items()})
    for klass in reversed(_legacy_classes(cls)):
        for name, p in inspect.signature(vars(klass)["__init__"]).parameters.items():
            if p.kind is p.KEYWORD_ONLY and name not in SHARED | {"params", "probabilities"}:
                out[name.replace("_", "-")] = p.default
    return out


def build_strategy(
    spec: str,
    *,
    probabilities: Callable[[int], np.ndarray] | None = None,
    run_config: Mapping[str, Any] | None = None,
    **shared: Any,
) -> AvailabilityStrategy:
    """Build the strategy ``spec`` names; only oracles receive ``probabilities``.

    ``shared``: :class:`StrategyParams` fields (Flower's ``FedAvg`` arguments among them); any other
    is a ValueError that lists them. ``run_config`` (a ServerApp's ``context.run_config``): its
    ``num-clients``, when it has one and ``num_clients`` is not given, is N.
    """
    unknown = sorted(set(shared) - SHARED - SPEC_SHARED)
    if unknown:
        raise ValueError(f"build_strategy: unknown argument(s) {unknown}; the strategies take "
                         f"{sorted(SHARED | SPEC_SHARED)} and their spec's own parameters")
    if run_config is not None and shared.get("num_clients") is None and "num-clients" in run_config:
        shared["num_clients"] = int(run_config["num-clients"])
    cls, label, kwargs = _rule_and_params(spec)
    if is_oracle(cls) or ("rule" in kwargs and kwargs["rule"].needs.oracle):
        if probabilities is None:
            raise ValueError(f"strategy {label!r} is an oracle: it needs the schedule's probabilities")
        kwargs["probabilities"] = probabilities
    return cls(**kwargs, **shared)


def _rule_class(spec: str) -> tuple[type[AvailabilityStrategy], str, str, Rule | None]:
    """(the rule class, its name for messages, the spec to read its parameters from, and a user's
    rule value: then the class is :class:`RuleStrategy`, the adapter it runs in)."""
    ref = resolve(spec, "strategy", builtin=lambda name: name in STRATEGIES)
    if ref is None:
        name = parse_spec(spec).name
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}{did_you_mean(name, STRATEGIES)}; known: {sorted(STRATEGIES)}, "
                             "or a rule of your "
                             "own as 'module:Class[:key=value,...]' (docs/extending.md)")
        return STRATEGIES[name], name, spec, None
    cls = ref.obj
    value = isinstance(cls, type) and issubclass(cls, Rule)
    if not (value or isinstance(cls, type) and issubclass(cls, AvailabilityStrategy)):
        raise ExtensionError(f"strategy {ref.name!r} is {cls!r}, not a rule class: a strategies.contract.Rule (the "
                             "rule as a value, docs/extending.md) or a subclass of a rule class of strategies")
    label = own_name(cls, ref.name)
    own_spec = f"{label}:{ref.params}" if ref.params else label
    return (RuleStrategy, f"{ref.name} ({label})", own_spec, cls()) if value else \
        (cls, f"{ref.name} ({label})", own_spec, None)


def own_name(cls: type[AvailabilityStrategy] | type[Rule], reference: str) -> str:
    """A user's rule class's own name, set as its ``name``: the one its class body declares, else
    its class name in kebab-case (``MomentumAvg`` -> ``momentum-avg``), never its parent's, so
    logs, errors, checkpoints and results say which rule ran. A built-in rule's name is refused
    for another class (a checkpoint of one would load into the other)."""
    declared = vars(cls).get("name")
    name = declared if isinstance(declared, str) and declared else kebab(cls.__name__)
    if not re.fullmatch(r"[a-z][a-z0-9_\-]*", name):
        raise ExtensionError(f"strategy {reference!r}: name {name!r} must be lower-case letters, digits, '-', '_'")
    if STRATEGIES.get(name, cls) is not cls:
        raise ExtensionError(f"strategy {reference!r} is named {name!r}, the name of the built-in rule "
                             f"{STRATEGIES[name].__name__}: declare another ``name = ...`` in its class body")
    cls.name = name
    return name


def kebab(class_name: str) -> str:
    """``MomentumAvg`` -> ``momentum-avg``, ``FedAvgM`` -> ``fed-avg-m``, ``ABCRule`` -> ``abc-rule``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", class_name).lower()


def _rule_and_params(spec: str) -> tuple[type[AvailabilityStrategy], str, dict[str, Any]]:
    """The rule class ``spec`` names, its name for messages, and its spec parameters as keyword
    arguments, type-checked against the class's own defaults."""
    cls, label, own_spec, value = _rule_class(spec)
    parsed = parse_spec(own_spec)
    cls = secure_class(cls, parsed.params.get("secure"))  # spec option secure=secagg+ (or the rule's refusal)
    allowed = strategy_params(cls, value)
    params = parsed.take({k: (v if v is not inspect.Parameter.empty else None) for k, v in allowed.items()},
                         what="strategy")
    missing = [k for k, v in allowed.items() if v is inspect.Parameter.empty and parsed.params.get(k) is None]
    if missing:
        raise SpecError(f"strategy {label!r} needs parameter(s) {missing}")
    return cls, label, {k.replace("-", "_"): v for k, v in params.items()} | ({"rule": value} if value else {})


def rule_spec(spec: str) -> tuple[type[AvailabilityStrategy], dict[str, Any]]:
    """The rule class a spec names and its spec parameters as keyword arguments, checked as
    :func:`build_strategy` checks them: for ``class Mine(Rule)`` written by a user, built as
    ``Mine(**params, fraction_evaluate=...)``. Oracles (they need the schedule) are refused."""
    cls, label, params = _rule_and_params(spec)
    if is_oracle(cls) or ("rule" in params and params["rule"].needs.oracle):
        raise ValueError(f"strategy {label!r} is an oracle: build it with build_strategy(spec, probabilities=...)")
    return cls, params


def is_asynchronous(strategy: AvailabilityStrategy | type[AvailabilityStrategy]) -> bool:
    """Whether ``strategy`` (a rule instance or class) runs in the asynchronous loop (it declares
    ``asynchronous``: :class:`strategies.asynchronous.AsyncRule`)."""
    return strategy.asynchronous


def is_asynchronous_spec(spec: str) -> bool:
    """Whether the rule a ``strategy`` spec names is asynchronous (False for a spec no rule has:
    the run's own checks then say what is wrong with it)."""
    try:
        return is_asynchronous(rule_spec(spec)[0])
    except Exception:  # noqa: BLE001 (an oracle, or a bad spec)
        return False
