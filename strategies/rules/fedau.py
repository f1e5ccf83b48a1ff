"""FedAU: FedAvg with online estimates of the participation weights.

Wang & Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in Federated
Averaging", ICML 2024, Alg. 1 (aggregation) and Alg. 2 (online weight estimation), following the
official code (IBM/fedau, main.py, ``weighting_method == 'adaptive'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import AvailabilityStrategy, ClientReport
from ..streaming import Fold, RunningSum, step
from ..weighting import LONG_SILENT_ROUNDS, cap_rare_weights


@dataclass
class FedAUState:
    """c_i, the sum and number of each client's recorded participation intervals, and who was seen."""

    count: np.ndarray | None = None
    interval_sum: np.ndarray | None = None
    interval_num: np.ndarray | None = None
    seen: np.ndarray | None = None  # whether a reply of the client was ever accepted
    absent: np.ndarray | None = None  # rounds since the client's last accepted reply (the cutoff does not reset it)


class FedAU(AvailabilityStrategy):
    """FedAU (Wang & Ji, ICML 2024, Alg. 1-2): u = (1/N) Σ_{i∈A_t} ω_i Δ_i, x ← x + η_g u.

    Per client: c_i (rounds absent since the last recorded interval), and the sum and number of
    its recorded participation intervals (3 scalars per client). Every round, for every client:

    - i ∈ A_t: ω_i = mean of its PAST intervals (1 if none yet: causal), then record the interval
      c_i + 1 and reset c_i = 0;
    - i ∉ A_t: c_i += 1; if c_i ≥ K, record an interval K and reset c_i = 0 (cutoff K,
      ``cutoff``; 0 or negative disables it, as the official code's default does in effect).

    The absent clients' bookkeeping runs in every round, empty rounds included (an empty round
    leaves the model as it is). For Bernoulli(p_i) participation ω_i → 1/p_i (K = ∞). A client's
    first accepted reply gets at most the largest ω of the clients seen before
    (:meth:`newcomer_cap`), so a squatter on an id silent for K rounds gains no weight of K. With
    the bounds on (``max-norm-ratio`` > 0) a client back after ``LONG_SILENT_ROUNDS`` (50) rounds
    or more gets at most the largest ω of the other clients seen before
    (:func:`strategies.weighting.cap_rare_weights`): an honest rare client too (it cannot be told
    from one reply of an attacker after a long silence); ``max-norm-ratio=0``: the paper's ω.
    Metrics ``mean-omega`` (the mean ω_i of the round's participants), ``weights-capped``.
    """

    equal_weights_only = True
    needs_client_ids = True
    name = "fedau"
    State = FedAUState
    streams = True

    def __init__(self, *, cutoff: int = 50, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cutoff = int(cutoff)
        self.count: np.ndarray | None = None  # c_i
        self.interval_sum: np.ndarray | None = None  # Σ of recorded intervals
        self.interval_num: np.ndarray | None = None  # number of recorded intervals
        self.seen: np.ndarray | None = None  # clients with an accepted reply (newcomer_cap)
        self.absent: np.ndarray | None = None  # rounds since each client's last accepted reply
        if self.num_clients is not None:
            self._init_state(self.num_clients)

    def _init_state(self, n: int) -> None:
        self.count = np.zeros(n, np.int64)
        self.interval_sum = np.zeros(n, np.int64)
        self.interval_num = np.zeros(n, np.int64)
        self.seen = np.zeros(n, bool)
        self.absent = np.zeros(n, np.int64)

    def omega(self) -> np.ndarray:
        """The current ω_i of every client (mean of past intervals, 1 if none)."""
        assert self.interval_sum is not None and self.interval_num is not None
        return np.where(self.interval_num > 0, self.interval_sum / np.maximum(self.interval_num, 1), 1.0)

    def newcomer_cap(self) -> float:
        """The largest ω of the clients accepted before (1 when none has): a client never accepted
        before (its intervals only the cutoff's, from absence: a new or long-silent id, a squatter's)
        gets at most this, so it gains no more weight than a returning client. Unchanged from the
        paper while no newcomer's absence outweighs every returning client's."""
        if self.seen is None:  # a checkpoint from before: every client with intervals counts as seen
            assert self.interval_num is not None
            self.seen = self.interval_num > 0
        return float(self.omega()[self.seen].max()) if self.seen.any() else 1.0

    def cap_rare(self, ids: np.ndarray, omega: np.ndarray, every: np.ndarray) -> tuple[np.ndarray, int]:
        """``omega`` (clients ``ids``'s, newcomers capped) with the long-silent ones capped at the
        largest ω of the other clients seen (``every``: every client's ω), when the bounds are on."""
        if not self.bounds.max_norm_ratio:
            return omega, 0
        assert self.seen is not None
        if self.absent is None:  # a checkpoint from before
            self.absent = np.zeros(self.seen.size, np.int64)
        rare = ~self.seen[ids] | (self.absent[ids] >= LONG_SILENT_ROUNDS)
        return cap_rare_weights(omega, rare, np.where(self.seen, every, np.nan), ids)

    def start_round(self) -> int:
        """N, with the per-client state made on the first round."""
        n = self.require_num_clients()
        if self.count is None:
            self._init_state(n)
        return n

    def record(self, ids: np.ndarray) -> None:
        """This round's participation intervals (participants ``ids``) and the absent clients' counts."""
        n = self.require_num_clients()
        assert self.count is not None and self.interval_sum is not None and self.interval_num is not None
        present = np.zeros(n, bool)
        present[ids] = True
        assert self.seen is not None
        self.seen |= present
        if self.absent is None:
            self.absent = np.zeros(n, np.int64)
        self.absent[present] = 0
        self.absent[~present] += 1
        self.interval_sum[present] += self.count[present] + 1
        self.interval_num[present] += 1
        self.count[present] = 0
        self.count[~present] += 1
        if self.cutoff > 0:
            hit = ~present & (self.count >= self.cutoff)
            self.interval_sum[hit] += self.cutoff
            self.interval_num[hit] += 1
            self.count[hit] = 0

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return FedAUFold(self, x)

    def set_state(self, state: FedAUState) -> None:
        super().set_state(state)
        if self.count is None and self.num_clients is not None:  # saved before its first round
            self._init_state(self.num_clients)


class FedAUFold(Fold):
    """FedAU's u = (1/N) Σ ω_i Δ_i folded in reply by reply: ω_i from the state before the round
    (with the newcomer cap), the intervals recorded at :meth:`finish`."""

    def __init__(self, rule: FedAU, x: np.ndarray) -> None:
        self.rule, self.x = rule, x
        self.n = rule.start_round()
        self.omega = rule.omega()
        self.cap = rule.newcomer_cap()
        assert rule.seen is not None
        self.returning = rule.seen.copy()
        self.ids: list[int] = []
        self.sum = RunningSum(x.size)
        self.capped = 0

    def add(self, report: ClientReport) -> None:
        c = report.client_id
        w = float(self.omega[c]) if self.returning[c] else min(float(self.omega[c]), self.cap)
        ws, capped = self.rule.cap_rare(np.array([c]), np.array([w]), self.omega)
        self.capped += capped
        self.sum.add(float(ws[0]), report.delta)
        self.ids.append(c)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        self.rule.record(np.array(self.ids, np.int64))
        if not self.ids:
            return self.x, {}
        return step(self.x, self.rule.server_lr, self.sum.total / self.n), {
            "mean-omega": self.sum.weight / len(self.ids), "weights-capped": float(self.capped)}
