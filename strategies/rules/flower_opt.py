"""Flower's own server optimizers under client unavailability: FedAdam, FedYogi, FedAdagrad
(Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2) and FedAvgM (Hsu, Qi and
Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv:1909.06335, Sec. 3).

Composed with Flower's classes, not rewritten. The base has already bound replies to clients,
validated them and applied the sanity bounds; the rule averages the accepted updates as
``fedavg-active`` does (Δ̄ = Σ_i w_i Δ_i, the run's weighting; ``auto`` is Flower's n_i / n) and
takes Flower's own strategy's step (``flwr.serverapp.strategy.FedAdam``, ...) on it through
:class:`strategies.flower_step.FlowerStep`, which feeds Flower the averaged model x + Δ̄: Flower
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
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from flwr.serverapp import strategy as flower

from .. import state as rule_state
from ..base import AvailabilityStrategy, ClientReport
from ..flower_step import FlowerStep
from ..streaming import Fold, RunningSum, example_weight


@dataclass
class FedOptState:
    """Flower FedOpt's first and second moments ({"x": array}, None before the first round)."""

    m_t: dict[str, np.ndarray] | None = None
    v_t: dict[str, np.ndarray] | None = None


@dataclass
class FedAvgMState:
    """Flower FedAvgM's momentum vector ([array], None before the first round)."""

    momentum_vector: list[np.ndarray] | None = None


class _FlowerOptimizer(AvailabilityStrategy):
    """A rule whose server step is one of Flower's strategies' (``flower_class``, its options
    ``options``); its ``State`` names attributes of Flower's object (its moments), not of the rule."""

    flower_class: ClassVar[type] = type(None)
    paper_weighting = "num-examples"  # Flower's FedAvg inside its optimizers weights by num-examples
    step_key: ClassVar[str] = "eta"  # the spec key that is this optimizer's learning rate
    streams = True
    mean_of_updates = True  # the optimizer's step on the robust statistic of the round's Δ_i
    State: ClassVar[type] = FedOptState

    def use_optimizer(self, **options: Any) -> None:
        """Build Flower's optimizer with ``options`` (the rule's own keyword arguments)."""
        if self.server_lr != 1.0:
            raise ValueError(f"strategy '{self.name}': its server step is the optimizer's learning rate: set "
                             f"'{self.name}:{self.step_key}=...' and leave run config 'server-lr' at 1 "
                             f"(got {self.server_lr})")
        self.flower = FlowerStep(self.flower_class(**options))

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, Any]]:
        """``robust=median`` / ``trimmed-mean``: the optimizer's step on the robust statistic;
        else the fold's (:class:`OptimizerFold`)."""
        robust = self.robust_mean(reports)
        if robust is None:
            return super().aggregate(t, x, reports)
        return self.optimizer_step(t, x, robust)

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return OptimizerFold(self, t, x)

    def optimizer_step(self, t: int, x: np.ndarray, u: np.ndarray | int) -> tuple[np.ndarray, dict[str, float]]:
        """Flower's optimizer step from x^t with the round's weighted mean update u."""
        new = self.flower.step(t, x, u)
        return new, {"server-step-norm": float(np.linalg.norm(new - x))}

    def step_bound(self) -> float:
        """C η: the largest |x^{t+1}_j − x^t_j| any replies can cause (module docstring); inf
        where the optimizer has no such bound (FedAvgM: its step is its momentum's)."""
        return math.inf

    def get_state(self) -> Any:
        return rule_state.capture(self.flower.optimizer, self.State)

    def set_state(self, state: Any) -> None:
        rule_state.restore(self.flower.optimizer, state)


class OptimizerFold(Fold):
    """The weighted mean update Δ̄ folded in reply by reply (``fedavg-active``'s, the run's
    weights), then Flower's optimizer step on it."""

    def __init__(self, rule: _FlowerOptimizer, t: int, x: np.ndarray) -> None:
        self.rule, self.t, self.x = rule, t, x
        self.weight_of = example_weight(rule.weighting)
        self.sum = RunningSum(x.size)

    def add(self, report: ClientReport) -> None:
        self.sum.add(self.report_weight(report, self.weight_of), report.delta)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.sum.count:
            return self.x, {}
        return self.rule.optimizer_step(self.t, self.x, self.sum.total / self.sum.weight)


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


class FedAdam(_FlowerOptimizer):
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
    flower_class = flower.FedAdam

    def __init__(self, *, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 bias_correction: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_optimizer(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)
        self.bias_correction = bool(bias_correction)

    def optimizer_step(self, t: int, x: np.ndarray, u: np.ndarray | int) -> tuple[np.ndarray, dict[str, float]]:
        new, metrics = super().optimizer_step(t, x, u)
        if not self.bias_correction:  # Reddi et al. Alg. 2: undo Flower's η_t / η (round r = t + 1)
            b1, b2, r = self.flower.optimizer.beta_1, self.flower.optimizer.beta_2, t + 1
            scale = (1 - b1 ** (r + 1)) / np.sqrt(1 - b2 ** (r + 1))
            new = (x + scale * (new.astype(np.float64) - x)).astype(np.float32)
            metrics = {**metrics, "server-step-norm": float(np.linalg.norm(new - x))}
        return new, metrics

    def step_bound(self) -> float:
        opt = self.flower.optimizer
        return opt.eta * adam_ratio_bound(opt.beta_1, opt.beta_2, self.bias_correction)


class FedYogi(_FlowerOptimizer):
    """FedYogi (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedYogi``; its defaults.

    Step bound (:meth:`step_bound`): Yogi's v_t = v_{t−1} − (1 − β_2) g² sign(v_{t−1} − g²) (from 0)
    keeps v_t ≥ β_2 v_{t−1} and v_t ≥ (1 − β_2) g_t² (β_2 ≥ 1/2), so v_t ≥ β_2^k (1 − β_2) g_{t−k}²
    and |m_t| ≤ (1 − β_1) Σ_k β_1^k |g_{t−k}| ≤ √v_t (1 − β_1)/√(1 − β_2) Σ_k (β_1/√β_2)^k.
    """

    name = "fedyogi"
    flower_class = flower.FedYogi

    def __init__(self, *, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_optimizer(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)

    def step_bound(self) -> float:
        opt = self.flower.optimizer
        b1, b2 = opt.beta_1, opt.beta_2
        if not (0.5 <= b2 < 1 and 0 <= b1 < math.sqrt(b2)):
            return math.inf
        return opt.eta * (1 - b1) / math.sqrt(1 - b2) / (1 - b1 / math.sqrt(b2))


class FedAdagrad(_FlowerOptimizer):
    """FedAdagrad (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedAdagrad``; its defaults
    (Flower's has no first-moment momentum: β_1 = 0, so m_t = Δ_t).

    Step bound (:meth:`step_bound`): v_t = Σ_s g_s² ≥ g_t² = m_t², so every coordinate moves at most η.
    """

    name = "fedadagrad"
    flower_class = flower.FedAdagrad

    def __init__(self, *, eta: float = 1e-1, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_optimizer(eta=eta, tau=tau)

    def step_bound(self) -> float:
        return float(self.flower.optimizer.eta)


class FedAvgM(_FlowerOptimizer):
    """FedAvgM (Hsu et al., arXiv:1909.06335, Sec. 3) by Flower's ``FedAvgM``; its defaults
    (server-momentum 0 and server-learning-rate 1: plain FedAvg until you set them)."""

    name = "fedavgm"
    flower_class = flower.FedAvgM
    step_key = "server-learning-rate"
    State = FedAvgMState

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_optimizer(server_learning_rate=server_learning_rate, server_momentum=server_momentum)
