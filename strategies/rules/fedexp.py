"""FedExP: an extrapolated server step sized by the clients' disagreement.

Jhunjhunwala, Wang and Joshi, "FedExP: Speeding Up Federated Averaging via Extrapolation",
ICLR 2023, Eq. (9) and Alg. 1. With M = |A_t| and Δ̄ = (1/M) Σ_{i∈A_t} Δ_i,

    η_g^t = max{1, Σ_{i∈A_t} ‖Δ_i‖² / (2M (‖Δ̄‖² + ε))},    x^{t+1} = x^t + η_g^t Δ̄,

and the model that is reported (evaluated) is the average of the last two iterates
(x^{t+1} + x^t)/2, while training continues from x^{t+1} (Sec. 5, "averaging the last two iterates").
The step is the η_g^t metric ``fedexp-step`` of every round. ``server_lr`` (default 1) multiplies it.

``max_step`` (spec key ``max-step``, default 10; 0 = no cap) caps η_g^t. Eq. (9) has no upper
limit: two replies that cancel (Δ and −Δ) make ‖Δ̄‖ ≈ 0 and the step Σ‖Δ_i‖²/(2Mε), as large as
the clients like. Honest updates that merely disagree give at most M/2: for M orthogonal updates
of equal norm ‖Δ̄‖² = (1/M²) Σ‖Δ_i‖², so η_g^t = M/2. The paper's experiments sample M = 20
clients per round (M/2 = 10), and the largest fixed server step in its own FedAvg grid (Fig. 1:
η_g ∈ {0.1, ..., 10}) is 10, so 10 bounds what the paper relies on; raise it with M ≫ 20.

The official code (github.com/Divyansh03/FedExP, main.py) differs as follows (options here):

- it uses ε·M instead of ε (``eps_times_m=True``);
- it decays ε by decay² = 0.998² every round, first round included: ε_t = 0.001·0.998^{2(t+1)}.
  Here ε_t = eps·decay^t, so the code's schedule is ``eps=0.001*0.998**2, decay=0.998**2``;
- it decays the local learning rate by 0.998 per round, η_l·0.998^{t+1}. That is the client's
  business: run config ``lr-schedule = "exp:gamma=0.998"`` (η_l·0.998^t; set ``lr`` to
  0.998·η_l for the code's exact values);
- it weights clients by data size (``weighting="num-examples"``: Δ̄ = Σ p_i Δ_i and Σ p_i ‖Δ_i‖²
  in place of the 1/M means), and evaluates x^1 alone after the first round.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from ..base import AvailabilityStrategy, ClientReport, safe_norm
from ..streaming import Fold, RunningSum, example_weight


class FedExP(AvailabilityStrategy):
    """Extrapolated FedAvg (Jhunjhunwala et al., ICLR 2023, Eq. 9)."""

    name = "fedexp"
    streams = True

    def __init__(self, *, eps: float = 1e-3, eps_times_m: bool = False, decay: float = 1.0,
                 max_step: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not (math.isfinite(max_step) and (max_step == 0 or max_step >= 1)):
            raise ValueError(f"max_step (spec key max-step) must be a finite number >= 1 (0 = no cap), got {max_step}")
        self.max_step = float(max_step)
        self.eps = float(eps)
        self.eps_times_m = bool(eps_times_m)
        self.decay = float(decay)
        self.previous: np.ndarray | None = None  # x^t of the last aggregated round

    def epsilon(self, t: int, m: int) -> float:
        """ε used in round t (0-based) with m participants."""
        return self.eps * self.decay**t * (m if self.eps_times_m else 1)

    def extrapolate(self, t: int, x: np.ndarray, mean: np.ndarray, spread: float,
                    m: int) -> tuple[np.ndarray, dict[str, float]]:
        """x + η_g^t Δ̄ (Eq. 9) from Δ̄ and Σ p_i ‖Δ_i‖² of the round's m replies (‖Δ̄‖² in float64)."""
        denom = 2.0 * (safe_norm(mean) ** 2 + self.epsilon(t, m))
        step = max(1.0, spread / denom) if denom > 0 else 1.0
        if self.max_step:
            step = min(step, self.max_step)
        return (x + np.float32(self.server_lr * step) * mean).astype(np.float32, copy=False), {"fedexp-step": step}

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        self.previous = x
        return FedExPFold(self, t, x)

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """(x^{t+1} + x^t)/2: the model FedExP reports."""
        if self.previous is None or self.layout is None or self.layout.mismatch(arrays) is not None:
            return arrays
        return self.arrays_of((self.layout.flatten(arrays) + self.previous) / 2)


class FedExPFold(Fold):
    """FedExP's Δ̄ = Σ v_i Δ_i / W and Σ v_i ‖Δ_i‖² / W (v_i: n_i, or 1, or the held round's
    weights, :meth:`strategies.streaming.Fold.report_weight`; W = Σ v_i), folded in reply by reply."""

    def __init__(self, rule: FedExP, t: int, x: np.ndarray) -> None:
        self.rule, self.t, self.x = rule, t, x
        self.weight_of = example_weight(rule.weighting)
        self.sum = RunningSum(x.size)
        self.squares = 0.0  # Σ v_i ‖Δ_i‖² (from the norms parsing computed; float64: no overflow)

    def add(self, report: ClientReport) -> None:
        v = self.report_weight(report, self.weight_of)
        self.sum.add(v, report.delta)
        self.squares += v * self.rule.update_norm(report) ** 2

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.sum.count:
            return self.x, {}
        w = self.sum.weight
        return self.rule.extrapolate(self.t, self.x, self.sum.total / w, self.squares / w, self.sum.count)
