"""FedAvg baselines under client unavailability, as rule values (:mod:`strategies.contract`).

The three reference rules of the FedAU paper (Wang & Ji, "A Lightweight Method for Tackling
Unknown Participation Statistics in Federated Averaging", ICML 2024, Sec. 3 and Table 1) and of
FedAWE (Xiang et al., NeurIPS 2024, Table 2). With Δ_i the client's change and η_g the server
step, x^{t+1} = x^t + η_g u where

- FedAvgActive: u = Σ_{i∈A_t} w_i Δ_i / Σ_{i∈A_t} w_i, w = equal (or data-size) weights over the
  participants;
- FedAvgAll:    u = (1/N) Σ_{i∈A_t} Δ_i (absent clients count as zero updates);
- FedAvgKnownP: u = (1/N) Σ_{i∈A_t} Δ_i / p_i^t, an ORACLE that reads the schedule's true
  participation probabilities.

An empty round leaves the model as it is. Each rule is its fold (each reply added as it arrives;
a held round is the same fold, fed a block at a time) and, for the two means, its step on a
robust statistic of the round's Δ_i (``robust=median`` / ``trimmed-mean``). The Flower Strategy
classes of the same names (:class:`strategies.rule_strategy.RuleStrategy`) are what a Flower user
instantiates: ``FedAvgActive(num_clients=10, fraction_evaluate=0.5)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..contract import Finished, Needs, RoundContext, Rule
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..streaming import RunningSum, step


class MeanFold:
    """x + η_g Σ_i v_i Δ_i / scale: v_i = ``ctx.weight(report)`` (the run's weighting) or 1
    (``equal``); scale = Σ v_i, or a fixed ``scale`` (FedAvg over all N: N)."""

    def __init__(self, state: Any, ctx: RoundContext, scale: float | None = None, equal: bool = False) -> None:
        self.state, self.ctx, self.scale, self.equal = state, ctx, scale, equal
        self.sum = RunningSum(ctx.x.size)

    def add(self, report: ClientReport) -> None:
        self.sum.add(1.0 if self.equal else self.ctx.weight(report), report.delta)

    def finish(self) -> Finished:
        if not self.sum.count:
            return Finished(self.ctx.x, self.state, {})
        scale = self.sum.weight if self.scale is None else self.scale
        return Finished(step(self.ctx.x, self.ctx.server_lr, self.sum.total / scale), self.state, {})


class FedAvgActiveRule(Rule):
    """FedAvg over the clients that replied (McMahan et al., AISTATS 2017, Alg. 1).

    The paper weights client k by n_k / n (``paper_weighting``, what ``weighting="auto"`` gives):
    with η_g = 1 this is Flower's ``FedAvg``. The FedAU and FedAWE papers' "FedAvg over the active
    clients" weights them equally: their presets say ``weighting = "equal"``.
    """

    name = "fedavg-active"
    needs = Needs(paper_weighting="num-examples", mean_of_updates=True)  # p_k = n_k / n (Alg. 1)

    def fold(self, state: Any, ctx: RoundContext) -> MeanFold:
        return MeanFold(state, ctx)

    def robust_step(self, state: Any, ctx: RoundContext, statistic: np.ndarray, count: int) -> Finished:
        """x + η_g × the robust statistic of the round's Δ_i."""
        return Finished(step(ctx.x, ctx.server_lr, statistic), state, {})


class FedAvgAllRule(Rule):
    """FedAvg over all N clients, absent ones counting as zero (FedAU paper, Sec. 3)."""

    name = "fedavg-all"
    needs = Needs(num_clients=True, mean_of_updates=True)

    def fold(self, state: Any, ctx: RoundContext) -> MeanFold:
        return MeanFold(state, ctx, scale=float(ctx.require_num_clients()), equal=True)

    def robust_step(self, state: Any, ctx: RoundContext, statistic: np.ndarray, count: int) -> Finished:
        """x + η_g (|A_t|/N) × the robust statistic of the round's Δ_i."""
        return Finished(step(ctx.x, ctx.server_lr * (count / ctx.require_num_clients()), statistic), state, {})


class FedAvgKnownPRule(Rule):
    """FedAvg reweighted by the true p_i^t: an oracle (FedAU paper, Sec. 3; FedAWE Table 2).

    ``ctx.probabilities`` is p^t, indexed by client id; p below ``min_probability`` counts as it
    (a client that replied with p ≈ 0 would blow the update up). Metric ``mean-inverse-p``.
    """

    name = "fedavg-known-p"
    needs = Needs(client_ids=True, oracle=True, fixed_selection=(
        "it reweights by the true participation probabilities p_i^t of the schedule, "
        "which addressing a sampled fraction of the nodes would change"))
    min_probability = 1e-6

    def fold(self, state: Any, ctx: RoundContext) -> KnownPFold:
        return KnownPFold(state, ctx, self.min_probability)


class KnownPFold:
    """FedAvgKnownP's u = (1/N) Σ Δ_i / p_i^t, folded in reply by reply."""

    def __init__(self, state: Any, ctx: RoundContext, min_probability: float) -> None:
        assert ctx.probabilities is not None
        self.state, self.ctx, self.n = state, ctx, ctx.require_num_clients()
        self.p = np.maximum(ctx.probabilities, min_probability)
        self.sum = RunningSum(ctx.x.size)

    def add(self, report: ClientReport) -> None:
        self.sum.add(1.0 / float(self.p[report.client_id]), report.delta)

    def finish(self) -> Finished:
        if not self.sum.count:
            return Finished(self.ctx.x, self.state, {})
        return Finished(step(self.ctx.x, self.ctx.server_lr, self.sum.total / self.n), self.state,
                        {"mean-inverse-p": self.sum.weight / self.sum.count})


class FedAvgActive(RuleStrategy):
    """:class:`FedAvgActiveRule` as a Flower Strategy (McMahan et al., AISTATS 2017, Alg. 1)."""

    rule = FedAvgActiveRule()


class FedAvgAll(RuleStrategy):
    """:class:`FedAvgAllRule` as a Flower Strategy (FedAU paper, Sec. 3)."""

    rule = FedAvgAllRule()


class FedAvgKnownP(RuleStrategy):
    """:class:`FedAvgKnownPRule` as a Flower Strategy: ``FedAvgKnownP(probabilities=p)``, p(t) -> p^t."""

    rule = FedAvgKnownPRule()
