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
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import Finished, RoundContext, Rule
from ..layout import safe_norm
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..streaming import RunningSum


@dataclass(frozen=True)
class FedExPParams:
    """eps, eps_times_m, decay : ε_t = eps · decay^t (× M with ``eps_times_m``); max_step : the cap
    on η_g^t (0 = none; the module docstring)."""

    eps: float = 1e-3
    eps_times_m: bool = False
    decay: float = 1.0
    max_step: float = 10.0

    def __post_init__(self) -> None:
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not (math.isfinite(self.max_step) and (self.max_step == 0 or self.max_step >= 1)):
            raise ValueError(f"max_step (spec key max-step) must be a finite number >= 1 (0 = no cap), "
                             f"got {self.max_step}")

    def epsilon(self, t: int, m: int) -> float:
        """ε used in round t (0-based) with m participants."""
        return float(self.eps) * float(self.decay)**t * (m if self.eps_times_m else 1)


class FedExPRule(Rule):
    """Extrapolated FedAvg (Jhunjhunwala et al., ICLR 2023, Eq. 9); it scores (x^{t+1} + x^t)/2."""

    name = "fedexp"
    Params = FedExPParams

    def fold(self, state: Any, ctx: RoundContext) -> FedExPFold:
        return FedExPFold(self.params, state, ctx)

    def evaluated(self, state: Any, model: np.ndarray, ctx: RoundContext) -> np.ndarray:
        """(x^{t+1} + x^t)/2: the model FedExP reports."""
        return (model + ctx.x) / 2


class FedExPFold:
    """FedExP's Δ̄ = Σ v_i Δ_i / W and Σ v_i ‖Δ_i‖² / W (v_i: ``ctx.weight``, the run's weighting
    or the held round's weights; W = Σ v_i), folded in reply by reply, then Eq. (9)'s step."""

    def __init__(self, params: FedExPParams, state: Any, ctx: RoundContext) -> None:
        self.params, self.state, self.ctx = params, state, ctx
        self.sum = RunningSum(ctx.x.size)
        self.squares = 0.0  # Σ v_i ‖Δ_i‖² (from the norms parsing computed; float64: no overflow)

    def add(self, report: ClientReport) -> None:
        v = self.ctx.weight(report)
        self.sum.add(v, report.delta)
        self.squares += v * (report.norm if report.norm is not None else safe_norm(report.delta)) ** 2

    def finish(self) -> Finished:
        x = self.ctx.x
        if not self.sum.count:
            return Finished(x, self.state, {})
        w, m = self.sum.weight, self.sum.count
        mean, spread = self.sum.total / w, self.squares / w
        denom = 2.0 * (safe_norm(mean) ** 2 + self.params.epsilon(self.ctx.t, m))
        step = max(1.0, spread / denom) if denom > 0 else 1.0
        if self.params.max_step:
            step = min(step, float(self.params.max_step))
        return Finished((x + np.float32(self.ctx.server_lr * step) * mean).astype(np.float32, copy=False), self.state,
                        {"fedexp-step": step})


class FedExP(RuleStrategy):
    """:class:`FedExPRule` as a Flower Strategy (Jhunjhunwala et al., ICLR 2023, Eq. 9)."""

    rule = FedExPRule()
