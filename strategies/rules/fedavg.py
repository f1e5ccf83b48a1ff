"""FedAvg baselines under client unavailability.

The three reference rules of the FedAU paper (Wang & Ji, "A Lightweight Method for Tackling
Unknown Participation Statistics in Federated Averaging", ICML 2024, Sec. 3 and Table 1) and of
FedAWE (Xiang et al., NeurIPS 2024, Table 2). With Δ_i the client's change and η_g the server
step, x^{t+1} = x^t + η_g u where

- FedAvgActive: u = Σ_{i∈A_t} w_i Δ_i, w = equal (or data-size) weights over the participants;
- FedAvgAll:    u = (1/N) Σ_{i∈A_t} Δ_i (absent clients count as zero updates);
- FedAvgKnownP: u = (1/N) Σ_{i∈A_t} Δ_i / p_i^t, an ORACLE that reads the schedule's true
  participation probabilities (the only rule here that does).

An empty round leaves the model as it is. Each rule writes its update once, as its fold
(``start_fold``: each reply folded in as it arrives; a held round is folded the same way by the
base's :meth:`strategies.rule.Rule.aggregate`); an ``aggregate`` here only applies
``robust=median`` / ``trimmed-mean``, a statistic of every reply at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import AvailabilityStrategy, ClientReport
from ..streaming import Fold, RunningSum, WeightedMean, example_weight, step


class RunWeightedMean(WeightedMean):
    """x + η_g Σ_i w_i Δ_i / Σ_i w_i with the run's weights (:meth:`Fold.report_weight`)."""

    def __init__(self, x: np.ndarray, server_lr: float, weighting: str) -> None:
        super().__init__(x, server_lr, example_weight(weighting))

    def add(self, report: ClientReport) -> None:
        self.sum.add(self.report_weight(report, self.weight_of), report.delta)


class FedAvgActive(AvailabilityStrategy):
    """FedAvg over the clients that replied (McMahan et al., AISTATS 2017, Alg. 1).

    The paper weights client k by n_k / n (``paper_weighting``, what ``weighting="auto"`` gives):
    with η_g = 1 this is Flower's ``FedAvg``. The FedAU and FedAWE papers' "FedAvg over the active
    clients" weights them equally: their presets say ``weighting = "equal"``.
    """

    name = "fedavg-active"
    paper_weighting = "num-examples"  # p_k = n_k / n (McMahan et al. 2017, Alg. 1)
    streams = True
    mean_of_updates = True

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, Any]]:
        """``robust=median`` / ``trimmed-mean``: x + η_g × the robust statistic; else the fold's mean."""
        robust = self.robust_mean(reports)
        if robust is None:
            return super().aggregate(t, x, reports)
        return step(x, self.server_lr, robust), {}

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return RunWeightedMean(x, self.server_lr, self.weighting)


class FedAvgAll(AvailabilityStrategy):
    """FedAvg over all N clients, absent ones counting as zero (FedAU paper, Sec. 3)."""

    name = "fedavg-all"
    needs_num_clients = True
    streams = True
    mean_of_updates = True  # (|A_t|/N) × the robust statistic of the round's Δ_i

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, Any]]:
        """``robust=median`` / ``trimmed-mean``: x + η_g (|A_t|/N) × the robust statistic; else the fold's sum."""
        robust = self.robust_mean(reports)
        if robust is None:
            return super().aggregate(t, x, reports)
        return step(x, self.server_lr * (len(reports) / self.require_num_clients()), robust), {}

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return WeightedMean(x, self.server_lr, lambda r: 1.0, scale=float(self.require_num_clients()))


class FedAvgKnownP(AvailabilityStrategy):
    """FedAvg reweighted by the true p_i^t: an oracle (FedAU paper, Sec. 3; FedAWE Table 2).

    ``probabilities(t)`` returns p^t as an array indexed by client id.
    """

    needs_client_ids = True
    name = "fedavg-known-p"
    fixed_selection = ("it reweights by the true participation probabilities p_i^t of the schedule, "
                       "which addressing a sampled fraction of the nodes would change")
    min_probability = 1e-6  # a client that replied with p ≈ 0 would blow the update up
    streams = True

    def __init__(self, *, probabilities: Callable[[int], np.ndarray], **kwargs) -> None:
        super().__init__(**kwargs)
        self.probabilities = probabilities

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return KnownPFold(self, t, x)


class KnownPFold(Fold):
    """FedAvgKnownP's u = (1/N) Σ Δ_i / p_i^t, folded in reply by reply."""

    def __init__(self, rule: FedAvgKnownP, t: int, x: np.ndarray) -> None:
        self.n, self.x, self.server_lr = rule.require_num_clients(), x, rule.server_lr
        self.p = np.maximum(np.asarray(rule.probabilities(t), np.float64), rule.min_probability)
        self.sum = RunningSum(x.size)

    def add(self, report: ClientReport) -> None:
        self.sum.add(1.0 / float(self.p[report.client_id]), report.delta)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.sum.count:
            return self.x, {}
        return (step(self.x, self.server_lr, self.sum.total / self.n),
                {"mean-inverse-p": self.sum.weight / self.sum.count})
