"""Flower's own server optimizers under client unavailability: FedAdam, FedYogi, FedAdagrad
(Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2) and FedAvgM (Hsu, Qi and
Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv:1909.06335, Sec. 3).

Composed with Flower's classes, not rewritten. The base has already bound replies to clients,
validated them and applied the sanity bounds; the rule averages the accepted updates as
``fedavg-active`` does (Δ̄ = Σ_i w_i Δ_i, the run's weighting; ``auto`` is Flower's n_i / n) and hands Flower's own strategy
(``flwr.serverapp.strategy.FedAdam``, ...) one reply holding the averaged model x + Δ̄. Flower's
``aggregate_train`` takes the pseudo-gradient Δ̄ and applies its optimizer with its own parameters
and defaults; spec keys are Flower's keyword names in kebab-case
(``fedadam:eta=0.01,beta-1=0.9,beta-2=0.99,tau=0.001``, ``fedavgm:server-momentum=0.9``).
Flower is given the 1-based round t + 1, as its own ServerApp would (FedAdam's bias correction).

One definition of the server step: for these rules the server step IS the optimizer's learning
rate (``eta``; FedAvgM's ``server-learning-rate``). The run config's ``server-lr`` (η_g, which
multiplies the other rules' update) must stay 1; any other value is refused, naming the key to
set instead. The optimizer's moments are the rule's declared state (checkpointed, resumed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower

from ..base import AvailabilityStrategy, ClientReport
from ..streaming import Fold, WeightedMean, example_weight
from ..weighting import weighted_sum

KEY = "x"  # the one flat array Flower's optimizer sees (its updates are elementwise)


@dataclass
class FedOptState:
    """Flower FedOpt's first and second moments ({KEY: array}, None before the first round)."""

    m_t: dict[str, np.ndarray] | None = None
    v_t: dict[str, np.ndarray] | None = None


@dataclass
class FedAvgMState:
    """Flower FedAvgM's momentum vector ([array], None before the first round)."""

    momentum_vector: list[np.ndarray] | None = None


class _FlowerOptimizer(AvailabilityStrategy):
    """A rule whose server step is one of Flower's strategies' (``flower_class``)."""

    flower_class: ClassVar[type] = type(None)
    paper_weighting = "num-examples"  # Flower's FedAvg inside its optimizers weights by num-examples
    step_key: ClassVar[str] = "eta"  # the spec key that is this optimizer's learning rate
    streams = True
    mean_of_updates = True  # the optimizer's step on the robust statistic of the round's Δ_i

    def _setup_optimizer(self, **options: Any) -> None:
        if self.server_lr != 1.0:
            raise ValueError(f"strategy '{self.name}': its server step is the optimizer's learning rate: set "
                             f"'{self.name}:{self.step_key}=...' and leave run config 'server-lr' at 1 "
                             f"(got {self.server_lr})")
        self.optimizer = self.flower_class(**options)

    def _set_current(self, x: np.ndarray) -> None:
        self.optimizer.current_arrays = {KEY: x}

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        if not reports:
            return x, {}
        u: np.ndarray | int | None = self.robust_mean(reports)
        if u is None:
            w = self.weights(reports)
            u = weighted_sum(map(float, w), (r.delta for r in reports))
        return self.optimizer_step(t, x, u)

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return OptimizerFold(self, t, x)

    def optimizer_step(self, t: int, x: np.ndarray, u: np.ndarray | int) -> tuple[np.ndarray, dict[str, float]]:
        """Flower's optimizer step from x^t with the round's weighted mean update u."""
        self._set_current(np.asarray(x, np.float32))
        content = RecordDict({"arrays": ArrayRecord({KEY: Array(np.asarray(x + u, np.float32))}),
                              "metrics": MetricRecord({"num-examples": 1})})
        averaged = Message(content, dst_node_id=0, message_type=MessageType.TRAIN)
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.WARNING)  # its "Received 1 results" line would count the average as a reply
        try:
            arrays, _ = self.optimizer.aggregate_train(t + 1, [averaged])
        finally:
            flwr_log.setLevel(level)
        new = np.asarray(arrays[KEY].numpy(), np.float32)
        return new, {"server-step-norm": float(np.linalg.norm(new - x))}


class OptimizerFold(Fold):
    """The weighted mean update folded in reply by reply, then Flower's optimizer step."""

    def __init__(self, rule: _FlowerOptimizer, t: int, x: np.ndarray) -> None:
        self.rule, self.t, self.x = rule, t, x
        self.mean = WeightedMean(x, 1.0, example_weight(rule.weighting))

    def add(self, report: ClientReport) -> None:
        self.mean.add(report)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.mean.sum.count:
            return self.x, {}
        return self.rule.optimizer_step(self.t, self.x, self.mean.update())


class _FedOpt(_FlowerOptimizer):
    State = FedOptState

    @property
    def m_t(self) -> dict[str, np.ndarray] | None:
        return self.optimizer.m_t

    @m_t.setter
    def m_t(self, value: dict[str, np.ndarray] | None) -> None:
        self.optimizer.m_t = value

    @property
    def v_t(self) -> dict[str, np.ndarray] | None:
        return self.optimizer.v_t

    @v_t.setter
    def v_t(self, value: dict[str, np.ndarray] | None) -> None:
        self.optimizer.v_t = value


class FedAdam(_FedOpt):
    """FedAdam by Flower's ``FedAdam``; its defaults.

    Reddi et al., ICLR 2021, Alg. 2 step: x ← x + η m_t / (√v_t + τ). Flower's class adds Adam's
    bias correction (Kingma & Ba): η_t = η √(1 − β_2^(r+1)) / (1 − β_1^(r+1)), r its 1-based round
    (so the exponent runs one ahead of Adam's own t). ``bias_correction`` True (the default) is
    Flower's; False is Alg. 2 exactly (Flower's step rescaled by η / η_t).
    """

    name = "fedadam"
    flower_class = flower.FedAdam

    def __init__(self, *, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 bias_correction: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._setup_optimizer(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)
        self.bias_correction = bool(bias_correction)

    def optimizer_step(self, t: int, x: np.ndarray, u: np.ndarray | int) -> tuple[np.ndarray, dict[str, float]]:
        new, metrics = super().optimizer_step(t, x, u)
        if not self.bias_correction:  # Reddi et al. Alg. 2: undo Flower's η_t / η (round r = t + 1)
            b1, b2, r = self.optimizer.beta_1, self.optimizer.beta_2, t + 1
            scale = (1 - b1 ** (r + 1)) / np.sqrt(1 - b2 ** (r + 1))
            new = (x + scale * (new.astype(np.float64) - x)).astype(np.float32)
            metrics = {**metrics, "server-step-norm": float(np.linalg.norm(new - x))}
        return new, metrics


class FedYogi(_FedOpt):
    """FedYogi (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedYogi``; its defaults."""

    name = "fedyogi"
    flower_class = flower.FedYogi

    def __init__(self, *, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._setup_optimizer(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)


class FedAdagrad(_FedOpt):
    """FedAdagrad (Reddi et al., ICLR 2021, Alg. 2) by Flower's ``FedAdagrad``; its defaults
    (Flower's has no first-moment momentum: β_1 = 0, so m_t = Δ_t)."""

    name = "fedadagrad"
    flower_class = flower.FedAdagrad

    def __init__(self, *, eta: float = 1e-1, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._setup_optimizer(eta=eta, tau=tau)


class FedAvgM(_FlowerOptimizer):
    """FedAvgM (Hsu et al., arXiv:1909.06335, Sec. 3) by Flower's ``FedAvgM``; its defaults
    (server-momentum 0 and server-learning-rate 1: plain FedAvg until you set them)."""

    name = "fedavgm"
    flower_class = flower.FedAvgM
    step_key = "server-learning-rate"
    State = FedAvgMState

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._setup_optimizer(server_learning_rate=server_learning_rate, server_momentum=server_momentum)

    def _set_current(self, x: np.ndarray) -> None:
        self.optimizer.current_arrays = ArrayRecord({KEY: Array(x)})

    @property
    def momentum_vector(self) -> list[np.ndarray] | None:
        return self.optimizer.momentum_vector

    @momentum_vector.setter
    def momentum_vector(self, value: list[np.ndarray] | None) -> None:
        self.optimizer.momentum_vector = value
