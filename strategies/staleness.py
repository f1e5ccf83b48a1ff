"""The staleness functions of asynchronous rules: how much an update from an older model counts.

Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", arXiv:1903.03934 (2019), Sec. 5.2,
with δ the staleness (versions since the client's model): ``constant`` s = 1; ``poly``
s = (1 + δ)^(−a); ``hinge`` s = 1 if δ <= b else 1 / (a (δ − b) + 1) (as APPFL's and Plato's
FedAsync; FLGo's hinge omits the + 1). FedBuff, FedAsync and FedCompass weight by them.
"""

from __future__ import annotations

import numpy as np

STALENESS_FUNCTIONS = ("constant", "poly", "hinge")


def staleness_weight(kind: str, delta: int, a: float, b: float) -> float:
    """s(δ) of Xie et al. 2019, Sec. 5.2 (see the module docstring)."""
    if kind == "constant":
        return 1.0
    if kind == "poly":
        return float((1.0 + delta) ** (-a))
    if kind == "hinge":
        return 1.0 if delta <= b else 1.0 / (a * (delta - b) + 1.0)
    raise ValueError(f"staleness function {kind!r}: one of {STALENESS_FUNCTIONS}")


def check_staleness_params(name: str, kind: str, a: float, b: float) -> None:
    """ValueError naming the rule when the staleness function or its parameters are not valid."""
    if kind not in STALENESS_FUNCTIONS:
        raise ValueError(f"strategy '{name}': staleness={kind!r} is not one of {STALENESS_FUNCTIONS}")
    if not (np.isfinite(a) and a >= 0):
        raise ValueError(f"strategy '{name}': staleness-a={a} must be a finite number >= 0")
    if not (np.isfinite(b) and b >= 0):
        raise ValueError(f"strategy '{name}': staleness-b={b} must be a finite number >= 0")
