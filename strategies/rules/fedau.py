"""FedAU: FedAvg with online estimates of the participation weights, as a rule value.

Wang & Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in Federated
Averaging", ICML 2024, Alg. 1 (aggregation) and Alg. 2 (online weight estimation), following the
official code (IBM/fedau, main.py, ``weighting_method == 'adaptive'``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..contract import Finished, Needs, RoundContext, Rule
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..streaming import RunningSum, step
from ..weighting import LONG_SILENT_ROUNDS, cap_rare_weights


@dataclass(frozen=True)
class FedAUParams:
    """cutoff : K, the longest interval recorded (0 or negative: none, the official code's default
    in effect)."""

    cutoff: int = 50


@dataclass
class FedAUState:
    """c_i, the sum and number of each client's recorded participation intervals, and who was seen."""

    count: np.ndarray | None = None
    interval_sum: np.ndarray | None = None
    interval_num: np.ndarray | None = None
    seen: np.ndarray | None = None  # whether a reply of the client was ever accepted
    absent: np.ndarray | None = None  # rounds since the client's last accepted reply (the cutoff does not reset it)


def omega(state: FedAUState) -> np.ndarray:
    """The current ω_i of every client (mean of past intervals, 1 if none)."""
    assert state.interval_sum is not None and state.interval_num is not None
    return np.where(state.interval_num > 0, state.interval_sum / np.maximum(state.interval_num, 1), 1.0)


class FedAURule(Rule):
    """FedAU (Wang & Ji, ICML 2024, Alg. 1-2): u = (1/N) Σ_{i∈A_t} ω_i Δ_i, x ← x + η_g u.

    Per client: c_i (rounds absent since the last recorded interval), and the sum and number of
    its recorded participation intervals (3 scalars per client). Every round, for every client:

    - i ∈ A_t: ω_i = mean of its PAST intervals (1 if none yet: causal), then record the interval
      c_i + 1 and reset c_i = 0;
    - i ∉ A_t: c_i += 1; if c_i ≥ K, record an interval K and reset c_i = 0 (cutoff K,
      ``cutoff``; 0 or negative disables it, as the official code's default does in effect).

    The absent clients' bookkeeping runs in every round, empty rounds included (an empty round
    leaves the model as it is). For Bernoulli(p_i) participation ω_i → 1/p_i (K = ∞). A client's
    first accepted reply gets at most the largest ω of the clients seen before (the newcomer cap),
    so a squatter on an id silent for K rounds gains no weight of K. With the bounds on
    (``ctx.bounded``: ``max-norm-ratio`` > 0) a client back after ``LONG_SILENT_ROUNDS`` (50)
    rounds or more gets at most the largest ω of the other clients seen before
    (:func:`strategies.weighting.cap_rare_weights`): an honest rare client too (it cannot be told
    from one reply of an attacker after a long silence); ``max-norm-ratio=0``: the paper's ω.
    Metrics ``mean-omega`` (the mean ω_i of the round's participants), ``weights-capped``.
    """

    name = "fedau"
    Params, State = FedAUParams, FedAUState
    needs = Needs(client_ids=True, equal_weights_only=True)

    def init(self, ctx: RoundContext) -> FedAUState:
        n = ctx.require_num_clients()
        return FedAUState(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool),
                          np.zeros(n, np.int64))

    def fold(self, state: FedAUState, ctx: RoundContext) -> FedAUFold:
        if state.count is None:  # saved before its first round
            state = self.init(ctx)
        if state.seen is None:  # a checkpoint from before: every client with intervals counts as seen
            assert state.interval_num is not None
            state = replace(state, seen=state.interval_num > 0)
        if state.absent is None:  # a checkpoint from before
            assert state.seen is not None
            state = replace(state, absent=np.zeros(state.seen.size, np.int64))
        return FedAUFold(self.params.cutoff, state, ctx)


def recorded(state: FedAUState, ids: np.ndarray, n: int, cutoff: int) -> FedAUState:
    """The state after a round with participants ``ids``: their intervals, the absent clients' counts."""
    count, total, num = (np.array(a) for a in (state.count, state.interval_sum, state.interval_num))
    seen, absent = np.array(state.seen), np.array(state.absent)
    present = np.zeros(n, bool)
    present[ids] = True
    seen |= present
    absent[present] = 0
    absent[~present] += 1
    total[present] += count[present] + 1
    num[present] += 1
    count[present] = 0
    count[~present] += 1
    if cutoff > 0:
        hit = ~present & (count >= cutoff)
        total[hit] += cutoff
        num[hit] += 1
        count[hit] = 0
    return FedAUState(count, total, num, seen, absent)


class FedAUFold:
    """FedAU's u = (1/N) Σ ω_i Δ_i folded in reply by reply: ω_i from the state before the round
    (with the newcomer cap and, bounds on, the rare-client cap), the intervals recorded at :meth:`finish`."""

    def __init__(self, cutoff: int, state: FedAUState, ctx: RoundContext) -> None:
        assert state.seen is not None and state.absent is not None
        self.cutoff, self.state, self.ctx, self.n = cutoff, state, ctx, ctx.require_num_clients()
        self.omega = omega(state)
        self.cap = float(self.omega[state.seen].max()) if state.seen.any() else 1.0  # the newcomer cap
        self.returning = state.seen.copy()
        self.ids: list[int] = []
        self.sum = RunningSum(ctx.x.size)
        self.capped = 0

    def add(self, report: ClientReport) -> None:
        c = report.client_id
        w = float(self.omega[c]) if self.returning[c] else min(float(self.omega[c]), self.cap)
        if self.ctx.bounded:
            assert self.state.seen is not None and self.state.absent is not None
            ids = np.array([c])
            rare = ~self.state.seen[ids] | (self.state.absent[ids] >= LONG_SILENT_ROUNDS)
            ws, capped = cap_rare_weights(np.array([w]), rare, np.where(self.state.seen, self.omega, np.nan), ids)
            w, self.capped = float(ws[0]), self.capped + capped
        self.sum.add(w, report.delta)
        self.ids.append(c)

    def finish(self) -> Finished:
        state = recorded(self.state, np.array(self.ids, np.int64), self.n, self.cutoff)
        if not self.ids:
            return Finished(self.ctx.x, state, {})
        return Finished(step(self.ctx.x, self.ctx.server_lr, self.sum.total / self.n), state, {
            "mean-omega": self.sum.weight / len(self.ids), "weights-capped": float(self.capped)})


class FedAU(RuleStrategy):
    """:class:`FedAURule` as a Flower Strategy (Wang & Ji, ICML 2024, Alg. 1-2)."""

    rule = FedAURule()


__all__ = ["FedAU", "FedAURule", "FedAUState", "omega"]
