"""FL-FDMS and the baselines of its paper: friend model substitution for dropped clients.

Wang and Xu, "Friends to Help: Saving Federated Learning from Client Dropout" (arXiv 2205.13222,
also titled "Combating Client Dropout in Federated Learning via Friend Model Substitution"),
Alg. 1 (FL-FDMS), Sec. 5 (complexity reduction, Theorem 2) and Sec. 6 (baselines Full, Dropout,
Stale). With Δ_i the change of client i, A_t the clients that replied in round t, N the number of
clients and η_g the server step, every rule here sets x^{t+1} = x^t + η_g u:

- FLFDMS ("fl-fdms"): u = (1/N)(Σ_{i∈A_t} Δ_i + Σ_{k∉A_t} Δ_{φ(k)}), φ(k) the dropped client's
  friend, the most similar active client by the running mean of update similarities;
- Stale ("stale"): u = (1/N)(Σ_{i∈A_t} Δ_i + Σ_{k∉A_t, seen} y_k), y_k k's last upload;
- Full ("full"): an ORACLE in which every client trains every round (its train messages carry
  ``ignore-availability``), u = FedAvg over all replies.

"Dropout" (FedAvg over the active clients) is ``fedavg-active``. All of them weigh clients
equally (1/N), as the paper does; an empty round leaves the model as it is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..base import AvailabilityStrategy, ClientReport
from ..contract import Finished, RoundContext
from ..memory import ClientTable, StoredRule, StoredState
from ..protocol import IGNORE_AVAILABILITY
from ..rule_strategy import RuleStrategy
from .fedavg import FedAvgActiveRule

MIN_FRIENDS = 2  # max_friend_share never caps a client below this many dropped clients


@dataclass
class FLFDMSState:
    """R (running mean similarity, float64 N × N), N_ij (co-active rounds, int64 N × N) and the
    candidate sets C_k (bool N × N, rows; reduction); None before the first round."""

    R: np.ndarray | None = None
    count: np.ndarray | None = None
    candidates: np.ndarray | None = None


class FLFDMS(AvailabilityStrategy):
    """FL-FDMS (Wang & Xu, Alg. 1; complexity reduction: Sec. 5, Theorem 2).

    Per pair of co-active clients, r_ij = ½(cos(Δ_i, Δ_j) + 1) ∈ [0, 1] (a zero update has
    cos = 0), and the running mean over co-active rounds R_ij ← (N_ij R_ij + r_ij)/(N_ij + 1),
    N_ij += 1 (N × N, symmetric; pairs not both active keep their values). All pairs of a round
    come from ONE matrix product U Uᵀ of the stacked updates, divided by the outer product of the
    norms (the same as the product of the normalised matrix, without copying it).

    A dropped client k (an id in 0..N−1 that did not reply) gets the friend
    φ(k) = argmax_{j∈A_t} R_kj with the scores of the previous rounds (friends are chosen BEFORE
    this round's similarities enter R; k's own row cannot change this round anyway, since k is
    absent). Only pairs observed at least once (N_kj > 0) are eligible; ties go to the lowest
    client id. A dropped client with no observed pair to any active client (it missed every
    round it shared with them, e.g. it failed in round 0) has no friend: it is SKIPPED, i.e.
    counts as a zero update, as in FedAvg over all clients (metric ``num-unmatched``).

    Rounds t < ``warmup_rounds`` (paper: round 0 only) are sent with ``ignore-availability``
    so that every client trains and all similarities get initialised.

    Complexity reduction (``reduction=true``, Hoeffding races): each client k keeps a candidate
    set C_k (all other clients at first). After R is updated in round t,
    best = argmax_{i∈C_k, N_ki>0} R_ki and i leaves C_k for good if R_k,best − R_ki ≥ Θ_t, with

        Θ_t = theta_scale · sqrt((2 ln(2 K² T B_max) − 2 ln p) / (β t)) + δ_f + theta_offset,

    t = rounds so far (the 0-based round + 1, as the authors' code indexes it). Only pairs with
    both clients active and i ∈ C_j or j ∈ C_i get a similarity; the needed pairs are grouped
    into connected components, each computed as one contiguous block product (or row by row
    when the block would be mostly unneeded), so the saving is real. Friends are chosen within
    C_k ∩ A_t; if no candidate of k is active, the choice falls back to all active clients
    (metric ``friend-fallbacks``).

    Parameters (defaults: paper form; the numbers are the authors' code, ``FL_FDMS_CR/comr.py``)
    ------------------------------------------------------------------------------------------
    reduction : the complexity reduction (FL-FDMS-CR in the authors' code); off by default.
    k : K, the number of clients in the bound; 0 means N (code: m = 20 = N).
    t_max : T, the horizon of the union bound (code: T = 500 = its number of rounds).
    b_max : B_max, the bound of the bound's third factor (code: f_max = 3).
    p : the failure probability of the races (code: delta = 0.01).
    beta : β, the guaranteed fraction of rounds a pair is co-active, N_ij ≥ β t (code: 0.5).
    delta_f : δ_f of Theorem 2, the tolerated friend gap (0 here: no value was published).
    theta_scale : 1.0 is Theorem 2. The authors' code used
        Θ_t = 0.5 · sqrt((2 ln(2K²T f_max) − 2 ln δ) / (2 β t)) + 0.01 with β = 0.5: reproduce it
        with ``theta_scale=0.5, beta=1.0, theta_offset=0.01`` (or theta_scale = 0.5/√2, β = 0.5).
    theta_offset : an extra constant added to Θ_t (code: 0.01).
    warmup_rounds : rounds in which every client is asked to train (paper: 1, round 0).
    max_friend_share : one active client stands in for at most max(2, ⌈share × the round's
        dropped clients⌉) of them (default 0.5; 1 = the paper's argmax): a client that makes
        itself similar to everyone cannot take every dropped client's place. Only where the cap
        binds, the dropped clients (strongest score first) take their most similar active client
        with room (metric ``friends-moved``); otherwise friends are the paper's argmax, unchanged.

    Metrics: ``similarity-pairs`` (pairs whose similarity entered R this round),
    ``similarity-dots`` (dot products actually evaluated, ≥ pairs with the block products),
    ``num-substituted``, ``num-unmatched``; with the reduction also ``mean-candidates``,
    ``friend-fallbacks`` and ``theta``. The last round's friends are in ``self.friends``
    (dropped id -> friend id) and the phases' seconds in ``self.timings``.
    """

    equal_weights_only = True
    needs_client_ids = True  # R, counts and candidates are indexed by client id
    name = "fl-fdms"
    State = FLFDMSState
    rows_fraction = 0.2  # a block goes row by row (gemv) when it needs under this share of its pairs

    def __init__(self, *, reduction: bool = False, k: int = 0, t_max: int = 500, b_max: float = 3.0,
                 p: float = 0.01, beta: float = 0.5, delta_f: float = 0.0, theta_scale: float = 1.0,
                 theta_offset: float = 0.0, warmup_rounds: int = 1, max_friend_share: float = 0.5,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (math.isfinite(max_friend_share) and 0 < max_friend_share <= 1):
            raise ValueError(f"strategy '{self.name}': max_friend_share (spec key max-friend-share) must be in "
                             f"(0, 1] (1 = the paper's argmax), got {max_friend_share}")
        self.max_friend_share = float(max_friend_share)
        checks = [(k >= 0, "k", k, ">= 0 (0: N)"), (t_max >= 1, "t_max", t_max, ">= 1"),
                  (b_max > 0, "b_max", b_max, "> 0"), (0 < p < 1, "p", p, "in (0, 1)"),
                  (beta > 0, "beta", beta, "> 0"), (delta_f >= 0, "delta_f", delta_f, ">= 0"),
                  (theta_scale > 0, "theta_scale", theta_scale, "> 0"),
                  (theta_offset >= 0, "theta_offset", theta_offset, ">= 0"),
                  (warmup_rounds >= 0, "warmup_rounds", warmup_rounds, ">= 0")]
        for ok, key, value, want in checks:
            if not ok:
                raise ValueError(f"strategy '{self.name}': {key}={value!r} must be {want}")
        self.reduction = bool(reduction)
        self.k, self.t_max, self.b_max, self.p, self.beta = int(k), int(t_max), float(b_max), float(p), float(beta)
        self.delta_f, self.theta_scale, self.theta_offset = float(delta_f), float(theta_scale), float(theta_offset)
        self.warmup_rounds = int(warmup_rounds)
        self.R: np.ndarray | None = None  # running mean similarity, float64 N × N
        self.count: np.ndarray | None = None  # N_ij, co-active rounds, int64 N × N
        self.candidates: np.ndarray | None = None  # C_k as row k, bool N × N (reduction)
        self.friends: dict[int, int] = {}
        self.timings: dict[str, float] = {}

    # ----------------------------------------------------------------------------- hooks
    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        return {IGNORE_AVAILABILITY: True} if t < self.warmup_rounds else {}

    def theta(self, t: int) -> float:
        """Θ_t for the 0-based round t (the bound uses the round count t + 1)."""
        k = self.k or self.require_num_clients()
        arg = 2 * math.log(2 * k * k * self.t_max * self.b_max) - 2 * math.log(self.p)
        if arg <= 0:
            raise ValueError(f"strategy '{self.name}': 2 ln(2K²T·B_max) − 2 ln p = {arg:.3g} <= 0")
        return self.theta_scale * math.sqrt(arg / (self.beta * (t + 1))) + self.delta_f + self.theta_offset

    def friend_cap(self, dropped: int) -> int:
        """The most dropped clients one active client may stand in for: ⌈max_friend_share × dropped⌉,
        at least MIN_FRIENDS (2)."""
        return max(MIN_FRIENDS, math.ceil(self.max_friend_share * dropped - 1e-9))

    def _init_state(self) -> None:
        if self.R is None:
            n = self.require_num_clients()
            self.R = np.zeros((n, n), np.float64)
            self.count = np.zeros((n, n), np.int64)
            self.candidates = ~np.eye(n, dtype=bool)

    # ------------------------------------------------------------------------------ rule
    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        self._init_state()
        assert self.R is not None and self.count is not None and self.candidates is not None
        n = self.R.shape[0]
        metrics: dict[str, float] = {"similarity-pairs": 0, "similarity-dots": 0, "num-substituted": 0,
                                     "num-unmatched": 0}
        if self.reduction:
            metrics["friend-fallbacks"] = 0
        self.friends, self.timings = {}, {}
        if not reports:
            return x, metrics
        ids = np.array([r.client_id for r in reports], np.int64)  # sorted by the base

        # 1. friends of the dropped clients, from the scores of the previous rounds
        tic = time.perf_counter()
        dropped = np.setdiff1d(np.arange(n), ids)
        coef = np.ones(len(ids), np.float64)
        if len(dropped):
            scores = self.R[np.ix_(dropped, ids)]
            eligible = self.count[np.ix_(dropped, ids)] > 0
            if self.reduction:
                in_c = eligible & self.candidates[np.ix_(dropped, ids)]
                has = in_c.any(axis=1)
                metrics["friend-fallbacks"] = int((~has & eligible.any(axis=1)).sum())
                eligible = np.where(has[:, None], in_c, eligible)
            matched = eligible.any(axis=1)
            masked = np.where(eligible, scores, -np.inf)
            pick = masked.argmax(axis=1)[matched]
            cap = self.friend_cap(len(dropped))
            if pick.size and np.bincount(pick).max() > cap:  # the paper's argmax where no cap binds
                matched, pick, metrics["friends-moved"] = _capped_friends(masked, eligible, cap)
            coef += np.bincount(pick, minlength=len(ids))
            self.friends = dict(zip(dropped[matched].tolist(), ids[pick].tolist(), strict=True))
            metrics["num-substituted"] = int(matched.sum())
            metrics["num-unmatched"] = int((~matched).sum())

        # 2. stack the updates, grouped so that every block of needed pairs is contiguous
        need = np.ones((len(ids), len(ids)), bool)
        if self.reduction:
            sub = self.candidates[np.ix_(ids, ids)]
            need = sub | sub.T
        np.fill_diagonal(need, False)
        labels = _components(need)
        order = np.argsort(labels, kind="stable")
        self.timings["friends"] = time.perf_counter() - tic
        tic = time.perf_counter()
        U = self.stacked("updates", [reports[i].delta for i in order])
        self.timings["stack"] = time.perf_counter() - tic

        # 3. the update: u = (1/N) Σ_{i∈A_t} (1 + #dropped clients befriending i) Δ_i
        tic = time.perf_counter()
        u = (coef[order] / n).astype(np.float32) @ U
        new = x + np.float32(self.server_lr) * u
        self.timings["aggregate"] = time.perf_counter() - tic

        # 4. this round's similarities enter R (after the friends were chosen)
        tic = time.perf_counter()
        pairs, dots = self._update_similarities(U, ids[order], need[np.ix_(order, order)], labels[order])
        metrics["similarity-pairs"], metrics["similarity-dots"] = pairs, dots
        self.timings["similarity"] = time.perf_counter() - tic

        # 5. Hoeffding races: eliminate clearly worse candidates
        if self.reduction:
            theta = self.theta(t)
            observed = self.candidates & (self.count > 0)
            best = np.where(observed, self.R, -np.inf).max(axis=1, initial=-np.inf)
            self.candidates &= ~(observed & (best[:, None] - self.R >= theta))
            metrics["theta"] = theta
            metrics["mean-candidates"] = float(self.candidates.sum(axis=1).mean())
        return new, metrics

    def _update_similarities(self, U: np.ndarray, ids: np.ndarray, need: np.ndarray,
                             labels: np.ndarray) -> tuple[int, int]:
        """Fold r_ij of the needed pairs (rows of U are clients ``ids``) into R and N_ij."""
        assert self.R is not None and self.count is not None
        pairs = dots = 0
        bounds = np.flatnonzero(np.diff(labels)) + 1
        for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(ids)], strict=True):
            block_need = np.triu(need[a:b, a:b], 1)
            m, wanted = int(b - a), int(block_need.sum())
            if wanted == 0:
                continue
            S = U[a:b]
            rows = [(i, np.flatnonzero(block_need[i])) for i in range(m)]
            spans = sum(int(js[-1] - js[0] + 1) for _, js in rows if len(js))
            if spans < self.rows_fraction * m * (m - 1) / 2:
                # row by row over contiguous slices (no gathered copies)
                norms = np.sqrt(np.einsum("ij,ij->i", S, S, dtype=np.float64))
                G = np.zeros((m, m), np.float64)
                for i, js in rows:
                    if len(js):
                        G[i, js[0] : js[-1] + 1] = S[js[0] : js[-1] + 1] @ S[i]
                dots += spans
            else:
                G = (S @ S.T).astype(np.float64)
                norms = np.sqrt(np.clip(np.diag(G), 0, None))
                dots += m * (m - 1) // 2
            denom = np.outer(norms, norms)
            with np.errstate(divide="ignore", invalid="ignore"):
                cos = np.where(denom > 0, G / denom, 0.0)
            r = np.clip(0.5 * (cos + 1.0), 0.0, 1.0)
            ii, jj = np.nonzero(block_need)
            gi, gj = ids[a:b][ii], ids[a:b][jj]
            cnt = self.count[gi, gj]
            mean = (cnt * self.R[gi, gj] + r[ii, jj]) / (cnt + 1)
            self.R[gi, gj] = self.R[gj, gi] = mean
            self.count[gi, gj] = self.count[gj, gi] = cnt + 1
            pairs += wanted
        return int(pairs), int(dots)


def _capped_friends(masked: np.ndarray, eligible: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Friends when an argmax friend would stand in for more than ``cap`` dropped clients: the
    dropped clients in order of their best score (strongest first) each take their most similar
    eligible active client that still has room (ties: the lowest index), or none. Returns
    (matched mask, the picks of the matched, how many moved off their argmax)."""
    room = np.full(masked.shape[1], cap)
    first = masked.argmax(axis=1)
    choice = np.full(masked.shape[0], -1)
    for k in np.argsort(-masked.max(axis=1), kind="stable"):
        if not eligible[k].any():
            continue
        row = np.where(room > 0, masked[k], -np.inf)
        j = int(row.argmax())
        if np.isfinite(row[j]):
            choice[k] = j
            room[j] -= 1
    matched = choice >= 0
    return matched, choice[matched], int((matched & (choice != first)).sum() + (eligible.any(axis=1) & ~matched).sum())


def _components(adjacency: np.ndarray) -> np.ndarray:
    """Connected-component labels (0, 1, ... in order of first member) of a symmetric bool matrix."""
    m = len(adjacency)
    labels = np.arange(m)
    if m == 0 or not adjacency.any():
        return labels
    while True:  # min-label propagation; iterations <= the largest component's diameter
        new = np.minimum(labels, np.where(adjacency, labels[None, :], m).min(axis=1))
        if np.array_equal(new, labels):
            break
        labels = new
    return np.unique(labels, return_inverse=True)[1]


class StaleRule(StoredRule):
    """Stale updates (Wang & Xu, Sec. 6 baseline "FL-Stale"): a dropped client's last upload.

    y_k (:class:`ClientTable`, N × d float32, in RAM or a disk-backed memmap in ``memory_dir``)
    holds each client's latest Δ; after y_i ← Δ_i for i ∈ A_t,
    u = (1/N)(Σ_{i∈A_t} Δ_i + Σ_{k∉A_t, seen} y_k) = (1/N) Σ_k y_k (never-seen rows are zero).
    The same table as MIFA; unlike MIFA, an empty round leaves the model as it is.
    """

    name = "stale"

    def step(self, state: StoredState, table: ClientTable, ctx: RoundContext,
             reports: list[ClientReport]) -> Finished:
        table.set_rows([r.client_id for r in reports], [r.delta for r in reports])
        metrics: dict[str, float] = {"num-stale": int(table.seen.sum()) - len(reports)}
        if not reports:
            return Finished(ctx.x, state, metrics)
        return Finished(ctx.x + (ctx.server_lr * table.mean()).astype(np.float32), state, metrics)


class Stale(RuleStrategy):
    """:class:`StaleRule` as a Flower Strategy."""

    rule = StaleRule()


class FullRule(FedAvgActiveRule):
    """Full participation (Wang & Xu, Sec. 6 baseline "FL-Full"): an ORACLE, not a rule for churn.

    Every train message carries ``ignore-availability``, so every client trains every round
    despite the schedule (the server-side availability layer and the client-side gate both honour
    it; a real deployment whose nodes are stopped cannot); u = FedAvg over all replies, clients
    weighted equally (1/N) as the FL-FDMS paper's baselines.
    """

    name = "full"
    needs = replace(FedAvgActiveRule.needs, paper_weighting="equal",
                    fixed_selection="it trains every client every round, by definition")

    def train_config(self, state: Any, ctx: RoundContext) -> dict[str, Any]:
        return {IGNORE_AVAILABILITY: True}


class Full(RuleStrategy):
    """:class:`FullRule` as a Flower Strategy."""

    rule = FullRule()
