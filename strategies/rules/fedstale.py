"""FedStale: a convex combination of fresh and stale client updates.

Rodio and Neglia, "FedStale: leveraging stale client updates in federated learning",
arXiv 2405.04171 (2024), Alg. 1; official code arodio/FedStale (``utils/optim.py``,
``HistorySGD.step``: ``d_p.add_(history_d_p, alpha=history_coefficient)``, and
``history_tracker.py``, ``HistoryTracker.average``).

State y_i (client i's latest Δ_i, zero at start; N × d float32, as FedVARP's) and
ȳ = (1/N) Σ_j y_j as of the end of the previous round; β ∈ [0, 1] weighs the stale updates:

    v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − β y_i) + β ȳ,   x ← x + η_g v,   then y_i ← Δ_i (i ∈ A_t).

β = 0 is FedAvg over the active clients, β = 1 is FedVARP (Jhunjhunwala et al., UAI 2022); the
paper's point is that an intermediate β trades the variance FedVARP removes against the bias its
stale entries add when the clients' data are heterogeneous.

Paper and code: the code names β ``history_coefficient`` (the weight of the STALE term; the
issue's one-line summary "β × fresh + (1 − β) × stale" has it the other way round), and weights
client i by q_i / p_i with q_i = n_i / n and p_i its participation probability (known, or from
the code's ``ActivityEstimator``); here the weights are 1/|A_t| over the active clients by
default (``weights = "active"``), as this project's FedVARP (the FedAU/FedAWE code's form), so
β = 1 equals ``fedvarp`` exactly. ``weights = "paper"`` takes the paper's (and the code's
``UnbiasedClientsSampler`` + ``HistoryTracker.average``):

    v = Σ_{i∈A_t} (q_i / p_i)(Δ_i − β y_i) + β Σ_j q_j y_j,

q_i = 1/N (this rule weighs clients equally) and 1/p_i the code's ``ActivityEstimator`` (its
unknown-participation mode: the mean of the client's past participation intervals, 1 before its
first; no cutoff, as the code's default 1e8). Under uneven participation the two differ: a client
present every other round gets weight 2/N here and 1/|A_t| by default.
An empty round leaves the model as it is (as FedVARP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import ClientReport
from ..memory import StoredUpdates, TableState
from .fedvarp import stale_step


@dataclass
class FedStaleState(TableState):
    """The stored updates and, for the paper's weights, each client's participation intervals."""

    absent: np.ndarray | None = None  # rounds since its last participation
    interval_sum: np.ndarray | None = None
    interval_num: np.ndarray | None = None


class FedStale(StoredUpdates):
    """FedStale (Rodio & Neglia, arXiv 2405.04171, Alg. 1): v = mean_A(Δ_i − β y_i) + β ȳ.

    Parameters
    ----------
    beta : β, the weight of the stale updates (0 = FedAvg over the active clients, 1 = FedVARP).
    memory_dir : "" keeps the N × d table in RAM, else a memmap in that folder (as FedVARP).
    """

    name = "fedstale"
    State = FedStaleState

    def __init__(self, *, beta: float = 0.5, memory_dir: str = "", weights: str = "active", **kwargs: Any) -> None:
        super().__init__(memory_dir=memory_dir, **kwargs)
        if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
            raise ValueError(f"fedstale: beta must be in [0, 1] (0 = FedAvg, 1 = FedVARP), got {beta}")
        if weights not in ("active", "paper"):
            raise ValueError(f"fedstale: weights={weights!r} is not 'active' (1/|A_t|) or 'paper' (q_i / p_i)")
        self.beta, self.weights_kind = float(beta), weights
        self.absent: np.ndarray | None = None
        self.interval_sum: np.ndarray | None = None
        self.interval_num: np.ndarray | None = None

    def inverse_participation(self, ids: list[int]) -> np.ndarray:
        """1/p̂_i of ``ids`` (mean past interval, 1 before the first), then this round recorded
        (the code's ``ActivityEstimator``, causal: round t's weight reads rounds < t)."""
        n = self.require_num_clients()
        if self.absent is None or self.interval_sum is None or self.interval_num is None:
            self.absent, self.interval_sum, self.interval_num = (np.zeros(n, np.int64) for _ in range(3))
        present = np.zeros(n, bool)
        present[ids] = True
        omega = np.where(self.interval_num > 0, self.interval_sum / np.maximum(self.interval_num, 1), 1.0)[ids]
        self.interval_sum[present] += self.absent[present] + 1
        self.interval_num[present] += 1
        self.absent[present] = 0
        self.absent[~present] += 1
        return omega

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        ids = [r.client_id for r in reports]
        table = self._table(x.size, ids)
        omega = self.inverse_participation(ids) if self.weights_kind == "paper" else None
        if not reports:
            return x, {"num-seen": table.num_seen}
        if omega is None:
            return stale_step(table, x, reports, self.beta, self.server_lr), {"num-seen": table.num_seen}
        w = omega / self.require_num_clients()  # q_i / p_i, q_i = 1/N
        ybar, fresh, stale = table.mean(), np.zeros(x.size), np.zeros(x.size)
        table.set_rows(ids, [r.delta for r in reports], weights=list(w), fresh=fresh, stale=stale)
        v = fresh + self.beta * (np.asarray(ybar, np.float64) - stale)  # Σ w_i (Δ_i − β y_i) + β ȳ
        return x + (self.server_lr * v).astype(np.float32), {"num-seen": table.num_seen,
                                                             "mean-weight": float(w.mean())}
