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
Memory: two counters per client.

A new client id, or one back after g silent rounds, has a tiny π̂_i: one reply would weigh
1/(N π̂_i), up to t (measured, N = 8: 67.6 and 135 m from one reply after 100 rounds, and, with
only clients back after 50 rounds or more capped, 34 m after 49: the weight grows with g). With the
bounds on (``max-norm-ratio`` > 0) every reply weighs at most what another client seen before
would now (the largest of their 1/(N π̂_j): FedAU's newcomer cap,
:func:`strategies.weighting.cap_rare_weights`), so one reply moves the model at most 1.6 m
whatever its gap (1.25-1.56 m measured at g = 5 to 100). Only the rarest client's weight can
exceed every other's: an honest rare client is capped at the next rarest one's, since one reply
cannot tell it from an attacker's (counted as ``weights-capped``); ``max-norm-ratio=0``: the
paper's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..contract import Finished, Needs, RoundContext, Rule
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..streaming import RunningSum
from ..weighting import cap_rare_weights

ESTIMATES = ("share", "marginal")


@dataclass(frozen=True)
class DebiasedParams:
    """estimate : "share" (π̂_i = n_i / Σ n_j, the stationary share; the default) or "marginal"
    (p̂_i = n_i / (t + 1), the per-round participation probability)."""

    estimate: str = "share"

    def __post_init__(self) -> None:
        if self.estimate not in ESTIMATES:
            raise ValueError(f"debiased-fedavg: estimate must be one of {ESTIMATES}, got {self.estimate!r}")


@dataclass
class DebiasedState:
    """n_i, the participations of every client so far (None before the first round)."""

    counts: np.ndarray | None = None
    rounds: int = 0  # rounds observed (t + 1 after round t)


class DebiasedFedAvgRule(Rule):
    """Debiased FedAvg (Sun et al., ICLR 2025, Sec. 5): Δ_i weighted by 1/(N π̂_i), π̂ online."""

    name = "debiased-fedavg"
    Params, State = DebiasedParams, DebiasedState
    needs = Needs(client_ids=True, num_clients=True, equal_weights_only=True)

    def fold(self, state: DebiasedState, ctx: RoundContext) -> DebiasedFold:
        """The round's fold on the counts before it (made at the first round), t + 1 rounds observed."""
        n = ctx.require_num_clients()
        state = replace(state, rounds=ctx.t + 1,
                        counts=np.zeros(n, np.int64) if state.counts is None else state.counts)
        return DebiasedFold(self.params.estimate, state, ctx)


def capped_counts(state: DebiasedState, active: list[int], bounded: bool) -> tuple[np.ndarray, int]:
    """The counts (this round's included) that weigh the ``active`` clients: each raised to at
    least the smallest count of the other clients seen before (its weight then at most theirs),
    when the bounds are on; and how many were raised."""
    assert state.counts is not None
    ids = np.asarray(active, np.int64)
    after = state.counts[ids] + 1.0
    if not bounded:
        return after, 0
    rare = np.ones(len(ids), bool)  # every reply, whatever its gap (the module docstring)
    before = state.counts.astype(np.float64)
    factors, capped = cap_rare_weights(1.0 / after, rare, np.where(before > 0, 1.0 / (before + 1.0), np.nan), ids)
    return np.where(factors < 1.0 / after, 1.0 / factors, after), capped


class DebiasedFold:
    """The debiased update folded in reply by reply. Each client replies once a round, so its
    count after the round is c_i = n_i + 1 on arrival: "marginal" weights (t + 1)/(N c_i) are
    known then; "share" weights C/(N c_i |A_t|) (C = Σ_j n_j after the round) are Σ Δ_i / c_i
    scaled at the end."""

    def __init__(self, estimate: str, state: DebiasedState, ctx: RoundContext) -> None:
        self.estimate, self.state, self.ctx = estimate, state, ctx
        self.n = ctx.require_num_clients()
        self.sum = RunningSum(ctx.x.size)  # Σ Δ_i / c_i ("share") or Σ w_i Δ_i ("marginal")
        self.largest = 0.0  # the largest per-reply factor added
        self.ids: list[int] = []
        self.capped = 0

    def add(self, report: ClientReport) -> None:
        own, capped = capped_counts(self.state, [report.client_id], self.ctx.bounded)  # the counts before the round
        c = float(own[0])
        self.capped += capped
        w = 1.0 / c if self.estimate == "share" else self.state.rounds / (self.n * c)
        self.sum.add(w, report.delta)
        self.largest = max(self.largest, w)
        self.ids.append(report.client_id)

    def finish(self) -> Finished:
        assert self.state.counts is not None
        counts = self.state.counts.copy()  # this round's participations
        counts[self.ids] += 1
        state, x = replace(self.state, counts=counts), self.ctx.x
        if not self.ids:
            return Finished(x, state, {})
        m = len(self.ids)
        scale = float(counts.sum()) / (self.n * m) if self.estimate == "share" else 1.0
        u = scale * self.sum.total
        return Finished(x + (self.ctx.server_lr * u).astype(np.float32), state, {
            "mean-weight": scale * self.sum.weight / m, "max-weight": scale * self.largest,
            "weights-capped": float(self.capped)})


class DebiasedFedAvg(RuleStrategy):
    """:class:`DebiasedFedAvgRule` as a Flower Strategy (Sun et al., ICLR 2025, Sec. 5)."""

    rule = DebiasedFedAvgRule()
