"""Aggregation rules for federated learning under client unavailability (Message API).

The names below load on first use (PEP 562), so that importing a light submodule such as
``strategies.protocol`` (the wire protocol the ClientApp imports) or ``strategies.weighting``
imports no rule module; ``from strategies import build_strategy`` loads the registry, which
imports every rule.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AvailabilityStrategy": "base", "ClientReport": "replies", "Layout": "layout",
    "ReplyRejected": "replies", "RoundLog": "replies", "named_arrays": "layout",
    "FedAvgActive": "fedavg", "FedAvgAll": "fedavg", "FedAvgKnownP": "fedavg",
    "ORACLES": "registry", "STRATEGIES": "registry", "build_strategy": "registry", "rule_spec": "registry",
    "StrategyFailure": "failures",
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
