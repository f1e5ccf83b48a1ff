"""FedBuff: buffered asynchronous aggregation.

Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek and Huba, "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022, Alg. 1: the server adds each arriving client update to a
buffer and, once it holds K of them, applies their average with the server learning rate η_g:

    Δ̄ = Σ_{k=1}^{K} w_k s(t − τ_k) Δ_k,   x^{t+1} = x^t + η_g Δ̄,

Δ_k = x_k − x^{τ_k} the k-th buffered client change (from the version τ_k it was sent), w_k = 1/K
(the paper's average; ``weighting=num-examples`` gives n_k / Σ n over the buffer), and s the
paper's staleness scaling 1/√(1 + staleness) (``staleness=poly``, a = 0.5; Sec. 5 "we down-weight
stale updates", following Xie et al. 2019). FLGo's and Plato's FedBuff apply no staleness scaling:
``staleness=constant``. K = 10 as FLGo's default and the paper's main experiments.

Staleness is t − τ_k at arrival; arrivals older than ``max_staleness`` are rejected (recorded).
With K = the number of clients that reply at once and no staleness, FedBuff is FedAvg over them
(``fedavg-active`` with the same weighting and η_g).
"""

from __future__ import annotations

import numpy as np

from ..asynchronous import Arrival, AsyncRule
from ..staleness import check_staleness_params, staleness_weight
from ..weighting import weighted_sum


class FedBuff(AsyncRule):
    """FedBuff (Nguyen et al., AISTATS 2022, Alg. 1): every K arrivals, x += η_g Σ w_k s(δ_k) Δ_k."""

    name = "fedbuff"
    paper_weighting = "equal"  # Δ̄ / K (Alg. 1)

    def __init__(self, *, k: int = 10, staleness: str = "poly", staleness_a: float = 0.5,
                 staleness_b: float = 4.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"strategy 'fedbuff': k={k} (the buffer size K) must be >= 1")
        check_staleness_params(self.name, staleness, staleness_a, staleness_b)
        self.k, self.staleness = int(k), staleness
        self.staleness_a, self.staleness_b = float(staleness_a), float(staleness_b)

    @property
    def own_share_window(self) -> int:  # type: ignore[override]
        """A node's updates in one buffer of K are bounded as one (the module docstring of
        :mod:`strategies.asynchronous`)."""
        return self.k

    @property
    def buffer_size(self) -> int:
        """K: an aggregation waits for K arrivals."""
        return self.k

    def add(self, arrival: Arrival) -> bool:
        self.pending.append(arrival)
        return len(self.pending) >= self.k

    def apply(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """Σ w_k s(δ_k) Δ_k over the buffer (more than K after the start-up hold's release: one
        average of the held arrivals, which all trained from the first versions)."""
        reports = [a.report for a in self.pending]
        s = [staleness_weight(self.staleness, a.staleness, self.staleness_a, self.staleness_b) for a in self.pending]
        w = self.weights(reports)
        u = weighted_sum([float(wi) * si for wi, si in zip(w, s, strict=True)], (r.delta for r in reports))
        return x + self.server_lr * u, {"mean-staleness-weight": float(np.mean(s))}
