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
the code's ``ActivityEstimator``); here the weights are 1/|A_t| over the active clients, as this
project's FedVARP (the FedAU/FedAWE code's form), so β = 1 equals ``fedvarp`` exactly.
An empty round leaves the model as it is (as FedVARP).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base import ClientReport
from ..memory import StoredUpdates
from .fedvarp import stale_step


def fedstale_direction(deltas: np.ndarray, stored: np.ndarray, stored_mean: np.ndarray, beta: float) -> np.ndarray:
    """v = mean_i (Δ_i − β y_i) + β ȳ over the rows of ``deltas`` and ``stored`` (float64)."""
    fresh = np.asarray(deltas, np.float64).mean(axis=0)
    stale = np.asarray(stored, np.float64).mean(axis=0)
    return fresh + beta * (np.asarray(stored_mean, np.float64) - stale)


class FedStale(StoredUpdates):
    """FedStale (Rodio & Neglia, arXiv 2405.04171, Alg. 1): v = mean_A(Δ_i − β y_i) + β ȳ.

    Parameters
    ----------
    beta : β, the weight of the stale updates (0 = FedAvg over the active clients, 1 = FedVARP).
    memory_dir : "" keeps the N × d table in RAM, else a memmap in that folder (as FedVARP).
    """

    name = "fedstale"

    def __init__(self, *, beta: float = 0.5, memory_dir: str = "", **kwargs: Any) -> None:
        super().__init__(memory_dir=memory_dir, **kwargs)
        if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
            raise ValueError(f"fedstale: beta must be in [0, 1] (0 = FedAvg, 1 = FedVARP), got {beta}")
        self.beta = float(beta)

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        table = self._table(x.size, [r.client_id for r in reports])
        if not reports:
            return x, {"num-seen": table.num_seen}
        return stale_step(table, x, reports, self.beta, self.server_lr), {"num-seen": table.num_seen}
