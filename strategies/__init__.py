"""Aggregation rules for federated learning under client unavailability (Message API).

The names below load on first use (PEP 562), so that importing a light submodule such as
``strategies.protocol`` (the wire protocol the ClientApp imports) or ``strategies.weighting``
imports no rule module; ``from strategies import build_strategy`` loads the registry, which
imports every rule. The layout: the rules, one module each, in :mod:`strategies.rules`; the
plumbing they share here (:mod:`strategies.base`, the Flower adapter, composes the others).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    # plumbing
    "AvailabilityStrategy": "base", "ClientReport": "replies", "Layout": "layout",
    "ReplyRejected": "replies", "RoundLog": "replies", "named_arrays": "layout",
    "ORACLES": "registry", "STRATEGIES": "registry", "build_strategy": "registry", "rule_spec": "registry",
    "StrategyFailure": "failures", "StoredRule": "memory", "StrategyParams": "params",
    # the rules (strategies.rules), to build or subclass: ``from strategies import FedAU``
    "FedAvgActive": "rules.fedavg", "FedAvgAll": "rules.fedavg", "FedAvgKnownP": "rules.fedavg",
    "FedAU": "rules.fedau", "FedAWARE": "rules.fedaware", "FedAWE": "rules.fedawe",
    "FedExP": "rules.fedexp", "FedNova": "rules.fednova", "FedVARP": "rules.fedvarp",
    "ClusterFedVARP": "rules.fedvarp", "MIFA": "rules.mifa", "FLFDMS": "rules.fdms",
    "Stale": "rules.fdms", "Full": "rules.fdms", "PowerOfChoice": "rules.power_of_choice",
    "Scaffold": "rules.scaffold", "AmplifiedScaffold": "rules.scaffold", "FedPBC": "rules.fedpbc",
    "FedStale": "rules.fedstale", "DebiasedFedAvg": "rules.debiased_fedavg",
    "FedAdam": "rules.flower_opt", "FedYogi": "rules.flower_opt", "FedAdagrad": "rules.flower_opt",
    "FedAvgM": "rules.flower_opt", "FedBuff": "rules.fedbuff", "CA2FL": "rules.ca2fl", "FedAsync": "rules.fedasync",
    "FedCompass": "rules.fedcompass",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
