"""FedStale: a convex combination of fresh and stale client updates.

Rodio and Neglia, "FedStale: leveraging stale client updates in federated learning",
arXiv 2405.04171 (2024), Alg. 1; official code arodio/FedStale (``utils/optim.py``,
``HistorySGD.step``: ``d_p.add_(history_d_p, alpha=history_coefficient)``, and
``history_tracker.py``, ``HistoryTracker.average``).

State y_i (client i's latest Δ_i, zero at start; N × d float32, as FedVARP's) and
ȳ = (1/N) Σ_j y_j as of the end of the previous round; β ∈ [0, 1] weighs the stale updates:

    v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − β y_i) + β ȳ,   x ← x + η_g v,   then y_i ← Δ_i (i ∈ A_t).

β = 0 is FedAvg over the active clients, β = 1 is FedVARP (Jhunjhunwala et al., UAI 2022); the
paper's point is that an intermediate β trades the variance FedVARP removes against the bias its
stale entries add when the clients' data are heterogeneous.

Paper and code: the code names β ``history_coefficient`` (the weight of the STALE term; the
issue's one-line summary "β × fresh + (1 − β) × stale" has it the other way round), and weights
client i by q_i / p_i with q_i = n_i / n and p_i its participation probability (known, or from
the code's ``ActivityEstimator``); here the weights are 1/|A_t| over the active clients by
default (``weights = "active"``), as this project's FedVARP (the FedAU/FedAWE code's form), so
β = 1 equals ``fedvarp`` exactly. ``weights = "paper"`` takes the paper's (and the code's
``UnbiasedClientsSampler`` + ``HistoryTracker.average``):

    v = Σ_{i∈A_t} (q_i / p_i)(Δ_i − β y_i) + β Σ_j q_j y_j,

q_i = 1/N (this rule weighs clients equally) and 1/p_i the code's ``ActivityEstimator`` (its
unknown-participation mode: the mean of the client's past participation intervals, 1 before its
first; no cutoff, as the code's default 1e8). Under uneven participation the two differ: a client
present every other round gets weight 2/N here and 1/|A_t| by default.
An empty round leaves the model as it is (as FedVARP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..contract import Finished, RoundContext
from ..memory import ClientTable, StoredParams, StoredRule, StoredState
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from .fedvarp import stale_step


@dataclass(frozen=True)
class FedStaleParams(StoredParams):
    """beta : β, the weight of the stale updates (0 = FedAvg over the active clients, 1 = FedVARP).
    weights : "active" (1/|A_t|, the FedAU/FedAWE code's form) or "paper" (q_i / p_i)."""

    beta: float = 0.5
    weights: str = "active"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.beta) and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"fedstale: beta must be in [0, 1] (0 = FedAvg, 1 = FedVARP), got {self.beta}")
        if self.weights not in ("active", "paper"):
            raise ValueError(f"fedstale: weights={self.weights!r} is not 'active' (1/|A_t|) or 'paper' (q_i / p_i)")


@dataclass
class FedStaleState(StoredState):
    """The stored updates and, for the paper's weights, each client's participation intervals."""

    absent: np.ndarray | None = None  # rounds since its last participation
    interval_sum: np.ndarray | None = None
    interval_num: np.ndarray | None = None


def inverse_participation(state: FedStaleState, ids: list[int], n: int) -> tuple[np.ndarray, FedStaleState]:
    """1/p̂_i of ``ids`` (mean past interval, 1 before the first), and the state with this round
    recorded (the code's ``ActivityEstimator``, causal: round t's weight reads rounds < t)."""
    if state.absent is None or state.interval_sum is None or state.interval_num is None:
        state = replace(state, absent=np.zeros(n, np.int64), interval_sum=np.zeros(n, np.int64),
                        interval_num=np.zeros(n, np.int64))
    absent, total, num = np.array(state.absent), np.array(state.interval_sum), np.array(state.interval_num)
    present = np.zeros(n, bool)
    present[ids] = True
    omega = np.where(num > 0, total / np.maximum(num, 1), 1.0)[ids]
    total[present] += absent[present] + 1
    num[present] += 1
    absent[present] = 0
    absent[~present] += 1
    return omega, replace(state, absent=absent, interval_sum=total, interval_num=num)


class FedStaleRule(StoredRule):
    """FedStale (Rodio & Neglia, arXiv 2405.04171, Alg. 1): v = mean_A(Δ_i − β y_i) + β ȳ."""

    name = "fedstale"
    Params, State = FedStaleParams, FedStaleState

    def step(self, state: FedStaleState, table: ClientTable, ctx: RoundContext,
             reports: list[ClientReport]) -> Finished:
        ids = [r.client_id for r in reports]
        omega = None
        if self.params.weights == "paper":
            omega, state = inverse_participation(state, ids, ctx.require_num_clients())
        if not reports:
            return Finished(ctx.x, state, {"num-seen": table.num_seen})
        if omega is None:
            return Finished(stale_step(table, ctx.x, reports, self.params.beta, ctx.server_lr), state,
                            {"num-seen": table.num_seen})
        w = omega / ctx.require_num_clients()  # q_i / p_i, q_i = 1/N
        ybar, fresh, stale = table.mean(), np.zeros(ctx.x.size), np.zeros(ctx.x.size)
        table.set_rows(ids, [r.delta for r in reports], weights=list(w), fresh=fresh, stale=stale)
        v = fresh + self.params.beta * (np.asarray(ybar, np.float64) - stale)  # Σ w_i (Δ_i − β y_i) + β ȳ
        return Finished(ctx.x + (ctx.server_lr * v).astype(np.float32), state,
                        {"num-seen": table.num_seen, "mean-weight": float(w.mean())})


class FedStale(RuleStrategy):
    """:class:`FedStaleRule` as a Flower Strategy (Rodio & Neglia, arXiv 2405.04171, Alg. 1)."""

    rule = FedStaleRule()
