"""Debiased FedAvg under correlated (Markov) participation.

Sun, Zhang, Xu, Joshi, Sharma and Wei, "Debiasing Federated Learning with Correlated Client
Participation", ICLR 2025 (arXiv 2410.01209), Sec. 5 (the debiasing algorithm): participation
is a Markov chain whose stationary distribution π is unknown and not uniform, so FedAvg
converges to the π-weighted objective; the server estimates each client's stationary share
online from the participation it has seen and weights client i's update by 1/(N π̂_i):

    n_i ← n_i + 1 (i ∈ A_t),   π̂_i = n_i / Σ_j n_j,
    x ← x + η_g (1/|A_t|) Σ_{i∈A_t} Δ_i / (N π̂_i)                     (estimate="share")

With a fixed number K of clients per round (the paper's setting) this is the same as weighting by
the marginal participation probability p̂_i = n_i / (t + 1) ≈ K π_i:

    x ← x + η_g (1/N) Σ_{i∈A_t} Δ_i / p̂_i                              (estimate="marginal")

which differs from the share form only when |A_t| varies. The counts include the current round,
so p̂_i ≥ 1/(t + 1) > 0. No official code was found; this follows the paper's description.
Memory: one counter per client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import AvailabilityStrategy, ClientReport

ESTIMATES = ("share", "marginal")


def debiased_weights(counts: np.ndarray, rounds: int, active: list[int], estimate: str) -> np.ndarray:
    """The weight of each active client's Δ_i (they sum to ~1 when π̂ is right).

    ``counts``: participations per client including this round's; ``rounds``: t + 1."""
    counts = np.asarray(counts, np.float64)
    n = counts.size
    if estimate == "share":
        share = counts[active] / counts.sum()
        return 1.0 / (n * share * len(active))
    p = counts[active] / rounds
    return 1.0 / (n * p)


@dataclass
class DebiasedState:
    """n_i, the participations of every client so far (None before the first round)."""

    counts: np.ndarray | None = None
    rounds: int = 0  # rounds observed (t + 1 after round t)


class DebiasedFedAvg(AvailabilityStrategy):
    """Debiased FedAvg (Sun et al., ICLR 2025, Sec. 5): Δ_i weighted by 1/(N π̂_i), π̂ online.

    Parameters
    ----------
    estimate : "share" (π̂_i = n_i / Σ n_j, the stationary share; the default) or "marginal"
        (p̂_i = n_i / (t + 1), the per-round participation probability).
    """

    name = "debiased-fedavg"
    State = DebiasedState
    needs_client_ids = True
    needs_num_clients = True
    equal_weights_only = True

    def __init__(self, *, estimate: str = "share", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if estimate not in ESTIMATES:
            raise ValueError(f"debiased-fedavg: estimate must be one of {ESTIMATES}, got {estimate!r}")
        self.estimate = estimate
        self.counts: np.ndarray | None = None
        self.rounds = 0

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        n = self.require_num_clients()
        if self.counts is None:
            self.counts = np.zeros(n, np.int64)
        self.rounds = t + 1
        if not reports:
            return x, {}
        active = [r.client_id for r in reports]
        self.counts[active] += 1
        w = debiased_weights(self.counts, self.rounds, active, self.estimate)
        deltas = self.stacked("deltas", [r.delta for r in reports])
        u = np.einsum("i,ij->j", w, deltas.astype(np.float64))
        return x + (self.server_lr * u).astype(np.float32), {"mean-weight": float(w.mean()),
                                                              "max-weight": float(w.max())}
