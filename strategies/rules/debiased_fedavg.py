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
from ..streaming import Fold, RunningSum

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
    streams = True

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

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        n = self.require_num_clients()
        if self.counts is None:
            self.counts = np.zeros(n, np.int64)
        self.rounds = t + 1
        return DebiasedFold(self, x)


class DebiasedFold(Fold):
    """The debiased update folded in reply by reply. Each client replies once a round, so its
    count after the round is c_i = n_i + 1 on arrival: "marginal" weights (t + 1)/(N c_i) are
    known then; "share" weights C/(N c_i |A_t|) (C = Σ_j n_j after the round) are Σ Δ_i / c_i
    scaled at the end."""

    def __init__(self, rule: DebiasedFedAvg, x: np.ndarray) -> None:
        self.rule, self.x = rule, x
        self.n = rule.require_num_clients()
        self.sum = RunningSum(x.size)  # Σ Δ_i / c_i ("share") or Σ w_i Δ_i ("marginal")
        self.largest = 0.0  # the largest per-reply factor added
        self.ids: list[int] = []

    def add(self, report: ClientReport) -> None:
        assert self.rule.counts is not None
        c = float(self.rule.counts[report.client_id] + 1)
        w = 1.0 / c if self.rule.estimate == "share" else self.rule.rounds / (self.n * c)
        self.sum.add(w, report.delta)
        self.largest = max(self.largest, w)
        self.ids.append(report.client_id)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.ids:
            return self.x, {}
        counts = self.rule.counts
        assert counts is not None
        counts[self.ids] += 1
        m = len(self.ids)
        scale = float(counts.sum()) / (self.n * m) if self.rule.estimate == "share" else 1.0
        u = scale * self.sum.total
        return self.x + (self.rule.server_lr * u).astype(np.float32), {
            "mean-weight": scale * self.sum.weight / m, "max-weight": scale * self.largest}
