"""FedAsync: asynchronous federated optimization, one arrival at a time.

Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", arXiv:1903.03934 (2019), Alg. 1 and
Sec. 5.2: on each arrival of a client model x_new trained from version τ, with t the current version,

    α_t = α · s(t − τ),   x^{t} = (1 − α_t) x^{t−1} + α_t x_new,

here x_new = x^τ + Δ_i (the reply's model; Δ_i is what the sanity bounds check). s: ``constant``
(s = 1), ``poly`` (s = (1 + δ)^(−a)) or ``hinge`` (s = 1 for δ <= b, else 1 / (a (δ − b) + 1)).
Defaults: α = 0.6 and poly with a = 0.5 (FLGo's FedAsync defaults; the paper's FedAsync+Poly uses
a = 0.5, its hinge a = 10, b = 4). The server learning rate multiplies α_t (η_g = 1: the paper).
Arrivals older than ``max_staleness`` are rejected (recorded as stale).

Staleness numbering: here, as in FLGo, APPFL and Plato, a client that trained from the current
version has staleness t − τ = 0 (s = 1). In the paper's Alg. 1 the server's update t produces x_t
from x_{t−1}, and a worker that received (x_{t'}, t') sets τ = t'; so the freshest update, trained
from x_{t−1}, has t − τ = 1 (s(1) = 2^(−a) = 0.71 for poly a = 0.5). ``staleness_offset = 1``
follows the paper (s(δ + 1)); 0, the default, keeps the code's numbering. ``max_staleness`` and
the records count δ as here either way.
"""

from __future__ import annotations

import numpy as np

from ..asynchronous import Arrival, AsyncRule
from ..staleness import check_staleness_params, staleness_weight
from ..weighting import add_scaled


class FedAsync(AsyncRule):
    """FedAsync (Xie et al. 2019, Alg. 1): x ← (1 − α_t) x + α_t x_new, α_t = α s(t − τ)."""

    name = "fedasync"
    paper_weighting = "equal"  # one client at a time: no data-size weight

    def __init__(self, *, alpha: float = 0.6, staleness: str = "poly", staleness_a: float = 0.5,
                 staleness_b: float = 4.0, staleness_offset: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if staleness_offset not in (0, 1):
            raise ValueError(f"strategy 'fedasync': staleness-offset={staleness_offset} must be 0 (a fresh update "
                             f"has staleness 0) or 1 (Xie et al.'s numbering: t − τ >= 1)")
        self.staleness_offset = int(staleness_offset)
        if not (np.isfinite(alpha) and 0 < alpha <= 1):
            raise ValueError(f"strategy 'fedasync': alpha={alpha} must be in (0, 1]")
        check_staleness_params(self.name, staleness, staleness_a, staleness_b)
        self.alpha, self.staleness = float(alpha), staleness
        self.staleness_a, self.staleness_b = float(staleness_a), float(staleness_b)
        self._moved: np.ndarray | None = None  # x_new − x, reused across arrivals

    def mixing(self, staleness: int) -> float:
        """α_t = α s(t − τ), times η_g, at most 1."""
        s = staleness_weight(self.staleness, staleness + self.staleness_offset, self.staleness_a, self.staleness_b)
        return min(1.0, self.server_lr * self.alpha * s)

    def add(self, arrival: Arrival) -> bool:
        self.pending.append(arrival)
        return True

    def apply(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        alphas = []
        x = np.array(x, np.float32)  # a new version (x^t stays, jobs train from it)
        if self._moved is None or self._moved.shape != x.shape:
            self._moved = np.empty(x.shape, np.float32)
        moved = self._moved
        for a in self.pending:
            alpha_t = self.mixing(a.staleness)
            np.subtract(a.start, x, out=moved)
            moved += a.report.delta  # x_new − x
            x = add_scaled(x, alpha_t, moved)  # (1 − α_t) x + α_t x_new = x + α_t (x_new − x), in place
            alphas.append(alpha_t)
        return x, {"mixing": float(np.mean(alphas))}
