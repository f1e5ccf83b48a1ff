"""Flower's own server optimizers under client unavailability: FedAdam, FedYogi, FedAdagrad
(Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2) and FedAvgM (Hsu, Qi and
Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv:1909.06335, Sec. 3).

Composed with Flower's classes, not rewritten. The base has already bound replies to clients,
validated them and applied the sanity bounds; the rule averages the accepted updates as
``fedavg-active`` does (Δ̄ = Σ_i w_i Δ_i, the run's weighting; ``auto`` is Flower's n_i / n) and
takes Flower's own strategy's step (``flwr.serverapp.strategy.FedAdam``, ...) on it through
:class:`strategies.flower_step.FlowerStep` (built for each step, the moments set from the rule's
state and read back into the new one), which feeds Flower the averaged model x + Δ̄: Flower
takes the pseudo-gradient Δ̄ and applies its optimizer with its own parameters and defaults; spec
keys are Flower's keyword names in kebab-case
(``fedadam:eta=0.01,beta-1=0.9,beta-2=0.99,tau=0.001``, ``fedavgm:server-momentum=0.9``).
Flower is given the 1-based round t + 1, as its own ServerApp would (FedAdam's bias correction).

One definition of the server step: for these rules the server step IS the optimizer's learning
rate (``eta``; FedAvgM's ``server-learning-rate``). The run config's ``server-lr`` (η_g, which
multiplies the other rules' update) must stay 1; any other value is refused, naming the key to
set instead. The optimizer's moments are the rule's declared state (checkpointed, resumed).

The adaptive optimizers' step is bounded whatever the replies (``step_bound``, proved in each
class's docstring): every coordinate of x^{t+1} − x^t is at most C η, so ‖x^{t+1} − x^t‖ ≤ C η √d,
with C = 1 for FedAdagrad, C = (1 − β_1) / √(1 − β_2) / (1 − β_1/√β_2) for FedYogi (10.5 at its
defaults) and C = max_r √(1 − β_2^(r+1)) / (1 − β_1^(r+1)) (1 − β_1) / √(1 − β_2) √(Σ_{k<r} (β_1²/β_2)^k)
for FedAdam (2.35 at its defaults). An attacker can steer the step's direction (the sanity bounds
act on each Δ_i before the optimizer, and the optimizer normalises the mean's scale away), but
not its size: one round moves the model at most 2 C η √d from where the honest run's step would.
The bound cannot be tightened after the optimizer without cutting honest steps, which are of the
same size (docs/threat-model.md, "Adaptive optimizers").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
from flwr.serverapp import strategy as flower

from ..contract import Finished, Needs, RoundContext, Rule
from ..flower_step import FlowerStep
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..streaming import RunningSum


@dataclass
class FedOptState:
    """Flower FedOpt's first and second moments ({"x": array}, None before the first round)."""

    m_t: dict[str, np.ndarray] | None = None
    v_t: dict[str, np.ndarray] | None = None


@dataclass
class FedAvgMState:
    """Flower FedAvgM's momentum vector ([array], None before the first round)."""

    momentum_vector: list[np.ndarray] | None = None


class FlowerOptimizerRule(Rule):
    """A rule whose server step is one of Flower's strategies' (``flower_class``, built with the
    ``Params`` fields it takes); its ``State`` fields are attributes of Flower's object (its moments)."""

    flower_class: ClassVar[type] = type(None)
    State: ClassVar[type] = FedOptState
    # Flower's FedAvg inside its optimizers weights by num-examples; the robust stage: the
    # optimizer's step on the robust statistic of the round's Δ_i; the server step is the optimizer's
    needs = Needs(paper_weighting="num-examples", mean_of_updates=True, server_step="eta")

    def options(self) -> dict[str, Any]:
        """Flower's constructor arguments: the ``Params`` fields (FedAdam's bias_correction is ours)."""
        return {f.name: getattr(self.params, f.name) for f in fields(self.params)}

    def fold(self, state: Any, ctx: RoundContext) -> OptimizerFold:
        return OptimizerFold(self, state, ctx)

    def robust_step(self, state: Any, ctx: RoundContext, statistic: np.ndarray, count: int) -> Finished:
        """The optimizer's step on the robust statistic of the round's Δ_i."""
        return self.step(state, ctx.t, ctx.x, statistic)

    def step(self, state: Any, t: int, x: np.ndarray, u: np.ndarray | int) -> Finished:
        """Flower's optimizer step from x^t with the round's weighted mean update u, from the
        moments in ``state``; the new model, the new moments and ``server-step-norm``."""
        optimizer = self.flower_class(**self.options())
        for f in fields(state):
            setattr(optimizer, f.name, getattr(state, f.name))
        new = FlowerStep(optimizer).step(t, x, u)
        return Finished(new, type(state)(**{f.name: getattr(optimizer, f.name) for f in fields(state)}),
                        {"server-step-norm": float(np.linalg.norm(new - x))})

    def step_bound(self) -> float:
        """C η: the largest |x^{t+1}_j − x^t_j| any replies can cause (module docstring); inf
        where the optimizer has no such bound (FedAvgM: its step is its momentum's)."""
        return math.inf


class OptimizerFold:
    """The weighted mean update Δ̄ folded in reply by reply (``fedavg-active``'s, the run's
    weights: ``ctx.weight``), then Flower's optimizer step on it."""

    def __init__(self, rule: FlowerOptimizerRule, state: Any, ctx: RoundContext) -> None:
        self.rule, self.state, self.ctx = rule, state, ctx
        self.sum = RunningSum(ctx.x.size)

    def add(self, report: ClientReport) -> None:
        self.sum.add(self.ctx.weight(report), report.delta)

    def finish(self) -> Finished:
        if not self.sum.count:
            return Finished(self.ctx.x, self.state, {})
        return self.rule.step(self.state, self.ctx.t, self.ctx.x, self.sum.total / self.sum.weight)


def adam_ratio_bound(beta_1: float, beta_2: float, bias_correction: bool = True, rounds: int = 10_000) -> float:
    """sup over rounds r of |m| / √v times Flower's η_t / η (FedAdam's docstring): C, the largest
    step per coordinate in units of η (the larger of the first ``rounds`` rounds' and the limit,
    which the bias factor approaches from below); inf when β_1² ≥ β_2 (no bound)."""
    q = beta_1**2 / beta_2 if beta_2 > 0 else math.inf
    if not (0 <= beta_1 < 1 and 0 < beta_2 < 1 and q < 1):
        return math.inf
    limit = (1 - beta_1) / math.sqrt(1 - beta_2) / math.sqrt(1 - q)
    r = np.arange(1, rounds + 1, dtype=np.float64)
    ratio = (1 - beta_1) / math.sqrt(1 - beta_2) * np.sqrt((1 - q**r) / (1 - q))
    if bias_correction:
        ratio = ratio * np.sqrt(1 - beta_2 ** (r + 1)) / (1 - beta_1 ** (r + 1))
    return max(float(ratio.max()), limit)


@dataclass(frozen=True)
class FedAdamParams:
    """Flower's ``FedAdam`` arguments and defaults; bias_correction : Flower's η_t (True) or Alg. 2's η."""

    eta: float = 0.1
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    bias_correction: bool = True


class FedAdamRule(FlowerOptimizerRule):
    """FedAdam by Flower's ``FedAdam``; its defaults.

    Reddi et al., ICLR 2021, Alg. 2 step: x ← x + η m_t / (√v_t + τ). Flower's class adds Adam's
    bias correction (Kingma & Ba): η_t = η √(1 − β_2^(r+1)) / (1 − β_1^(r+1)), r its 1-based round
    (so the exponent runs one ahead of Adam's own t). ``bias_correction`` True (the default) is
    Flower's; False is Alg. 2 exactly (Flower's step rescaled by η / η_t).

    Step bound (:meth:`step_bound`): after r rounds m = (1 − β_1) Σ_{k<r} β_1^k g_{r−k} and
    v = (1 − β_2) Σ_{k<r} β_2^k g_{r−k}² per coordinate, so by Cauchy-Schwarz
    m² ≤ (1 − β_1)² Σ_{k<r} (β_1²/β_2)^k · v / (1 − β_2): |m| / √v ≤ (1 − β_1)/√(1 − β_2) √(Σ_{k<r} q^k),
    q = β_1²/β_2 < 1, times η_t / η; τ only shrinks the step.
    """

    name = "fedadam"
    Params = FedAdamParams
    flower_class = flower.FedAdam

    def options(self) -> dict[str, Any]:
        p = self.params
        return {"eta": p.eta, "beta_1": p.beta_1, "beta_2": p.beta_2, "tau": p.tau}

    def step(self, state: Any, t: int, x: np.ndarray, u: np.ndarray | int) -> Finished:
        done = super().step(state, t, x, u)
        if self.params.bias_correction:
            return done
        b1, b2, r = self.params.beta_1, self.params.beta_2, t + 1  # Alg. 2: undo Flower's η_t / η (round r = t + 1)
        scale = (1 - b1 ** (r + 1)) / np.sqrt(1 - b2 ** (r + 1))
        new = (x + scale * (done.model.astype(np.float64) - x)).astype(np.float32)
        return Finished(new, done.state, {**done.metrics, "server-step-norm": float(np.linalg.norm(new - x))})

    def step_bound(self) -> float:
        p = self.params
        return p.eta * adam_ratio_bound(p.beta_1, p.beta_2, p.bias_correction)


@dataclass(frozen=True)
class FedYogiParams:
    """Flower's ``FedYogi`` arguments and defaults."""

    eta: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3


class FedYogiRule(FlowerOptimizerRule):
    """FedYogi (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedYogi``; its defaults.

    Step bound (:meth:`step_bound`): Yogi's v_t = v_{t−1} − (1 − β_2) g² sign(v_{t−1} − g²) (from 0)
    keeps v_t ≥ β_2 v_{t−1} and v_t ≥ (1 − β_2) g_t² (β_2 ≥ 1/2), so v_t ≥ β_2^k (1 − β_2) g_{t−k}²
    and |m_t| ≤ (1 − β_1) Σ_k β_1^k |g_{t−k}| ≤ √v_t (1 − β_1)/√(1 − β_2) Σ_k (β_1/√β_2)^k.
    """

    name = "fedyogi"
    Params = FedYogiParams
    flower_class = flower.FedYogi

    def step_bound(self) -> float:
        b1, b2 = self.params.beta_1, self.params.beta_2
        if not (0.5 <= b2 < 1 and 0 <= b1 < math.sqrt(b2)):
            return math.inf
        return self.params.eta * (1 - b1) / math.sqrt(1 - b2) / (1 - b1 / math.sqrt(b2))


@dataclass(frozen=True)
class FedAdagradParams:
    """Flower's ``FedAdagrad`` arguments and defaults."""

    eta: float = 1e-1
    tau: float = 1e-3


class FedAdagradRule(FlowerOptimizerRule):
    """FedAdagrad (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedAdagrad``; its defaults
    (Flower's has no first-moment momentum: β_1 = 0, so m_t = Δ_t).

    Step bound (:meth:`step_bound`): v_t = Σ_s g_s² ≥ g_t² = m_t², so every coordinate moves at most η.
    """

    name = "fedadagrad"
    Params = FedAdagradParams
    flower_class = flower.FedAdagrad

    def step_bound(self) -> float:
        return float(self.params.eta)


@dataclass(frozen=True)
class FedAvgMParams:
    """Flower's ``FedAvgM`` arguments and defaults."""

    server_learning_rate: float = 1.0
    server_momentum: float = 0.0


class FedAvgMRule(FlowerOptimizerRule):
    """FedAvgM (Hsu et al., arXiv:1909.06335, Sec. 3) by Flower's ``FedAvgM``; its defaults
    (server-momentum 0 and server-learning-rate 1: plain FedAvg until you set them)."""

    name = "fedavgm"
    Params, State = FedAvgMParams, FedAvgMState
    flower_class = flower.FedAvgM
    needs = Needs(paper_weighting="num-examples", mean_of_updates=True, server_step="server-learning-rate")


class FedAdam(RuleStrategy):
    """:class:`FedAdamRule` as a Flower Strategy (Reddi et al., ICLR 2021, Alg. 2)."""

    rule = FedAdamRule()


class FedYogi(RuleStrategy):
    """:class:`FedYogiRule` as a Flower Strategy (Reddi et al., ICLR 2021, Alg. 2)."""

    rule = FedYogiRule()


class FedAdagrad(RuleStrategy):
    """:class:`FedAdagradRule` as a Flower Strategy (Reddi et al., ICLR 2021, Alg. 2)."""

    rule = FedAdagradRule()


class FedAvgM(RuleStrategy):
    """:class:`FedAvgMRule` as a Flower Strategy (Hsu et al., arXiv:1909.06335, Sec. 3)."""

    rule = FedAvgMRule()
