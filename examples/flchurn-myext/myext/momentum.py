"""FedAvgM as a rule value (Hsu, Qi and Brown, arXiv:1909.06335, Sec. 3): server momentum on
FedAvg's mean update, v ← β v + Δ̄, x ← x + η v, with Δ̄ the participants' weighted mean Δ_i.
Reached as ``strategy = "myext.momentum:ServerMomentum:beta=0.9"``; β = 0 is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategies.contract import Finished, Needs, RoundContext, Rule


@dataclass(frozen=True)
class MomentumParams:
    beta: float = 0.9  # spec key beta


@dataclass
class MomentumState:
    velocity: np.ndarray | None = None  # v, float64 (None before the first update)


class ServerMomentum(Rule):
    Params, State = MomentumParams, MomentumState
    needs = Needs(paper_weighting="num-examples")

    def fold(self, state: MomentumState, ctx: RoundContext) -> MomentumFold:
        return MomentumFold(self.params.beta, state, ctx)


class MomentumFold:
    def __init__(self, beta: float, state: MomentumState, ctx: RoundContext) -> None:
        self.beta, self.state, self.ctx = beta, state, ctx
        self.total, self.weight = np.zeros(ctx.x.size), 0.0

    def add(self, report) -> None:  # Σ w_i Δ_i, w_i the run's weighting
        w = self.ctx.weight(report)
        self.total += w * report.delta.astype(np.float64)
        self.weight += w

    def finish(self) -> Finished:
        if not self.weight:
            return Finished(self.ctx.x, self.state, {})
        mean, v = self.total / self.weight, self.state.velocity
        v = mean if v is None else self.beta * v + mean
        new = (self.ctx.x + self.ctx.server_lr * v).astype(np.float32)
        return Finished(new, MomentumState(v), {"velocity-norm": float(np.linalg.norm(v))})
