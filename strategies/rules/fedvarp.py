"""FedVARP and ClusterFedVARP: variance reduction for partial participation with stored updates.

Jhunjhunwala, Sharma, Nagarkatti and Joshi, "FedVARP: Tackling the Variance Due to Partial Client
Participation in Federated Learning", UAI 2022, Alg. 1 (FedVARP, Eq. 4) and Alg. 2
(ClusterFedVARP); the FedAU code (IBM/fedau, main.py, ``weighting_method == 'fedvarp'``) for the
empty round.

Empty round (A_t = ∅): the model stays as it is. The first term (1/|A_t|) Σ_{i∈A_t}(Δ_i − y_i)
is undefined there; the paper samples a non-empty set every round, so it never says, and the
official FedAU code (the source of the FedAWE/FedAU comparison numbers) applies a zero update
when no client participated. Applying ȳ alone would be MIFA's rule, not FedVARP's: its
unbiasedness argument E[(1/|A|) Σ_A (Δ_i − y_i)] = mean(Δ) − ȳ needs a non-empty sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from ..contract import Finished, RoundContext
from ..memory import ClientTable, StoredParams, StoredRule, StoredState
from ..replies import ClientReport
from ..rule_strategy import RuleStrategy
from ..weighting import weighted_sum


def stale_step(table: ClientTable, x: np.ndarray, reports: list[ClientReport], beta: float,
               server_lr: float) -> np.ndarray:
    """x + η_g v, v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − β y_i) + β ȳ (ȳ before the round), and then
    y_i ← Δ_i: Σ Δ_i and Σ y_i (float64) are summed in the pass that replaces the rows
    (:meth:`ClientTable.set_rows`). β = 1: FedVARP; FedStale's β."""
    ybar = table.mean()
    fresh, stale = np.zeros(x.size, np.float64), np.zeros(x.size, np.float64)
    table.set_rows([r.client_id for r in reports], [r.delta for r in reports], fresh=fresh, stale=stale)
    v = fresh / len(reports) + beta * (ybar - stale / len(reports))
    return x + (server_lr * v).astype(np.float32)


class FedVARPRule(StoredRule):
    """FedVARP (Jhunjhunwala et al., UAI 2022, Alg. 1, Eq. 4).

    State y_i (client i's latest Δ_i, zero at start; N × d float32 :class:`ClientTable`, in RAM
    or in a memmap under ``memory_dir``) and ȳ = (1/N) Σ_j y_j (the table's running mean):

        v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − y_i) + ȳ,   x ← x + η_g v,   then y_i ← Δ_i (i ∈ A_t).

    ȳ is the mean as of the end of the previous round. An empty round leaves the model as it is
    (see the module docstring).
    """

    name = "fedvarp"

    def step(self, state: StoredState, table: ClientTable, ctx: RoundContext,
             reports: list[ClientReport]) -> Finished:
        if not reports:
            return Finished(ctx.x, state, {"num-seen": table.num_seen})
        return Finished(stale_step(table, ctx.x, reports, 1.0, ctx.server_lr), state, {"num-seen": table.num_seen})


class FedVARP(RuleStrategy):
    """:class:`FedVARPRule` as a Flower Strategy (Jhunjhunwala et al., UAI 2022, Alg. 1)."""

    rule = FedVARPRule()


def _mean32(deltas: list[np.ndarray]) -> np.ndarray:
    """The mean of float32 vectors, summed in float64, as float32."""
    total = deltas[0].astype(np.float64)
    for delta in deltas[1:]:
        total += delta
    return (total / len(deltas)).astype(np.float32)


@dataclass(frozen=True)
class ClusterFedVARPParams(StoredParams):
    """clusters : C, contiguous near-equal blocks of client ids (0: one per client, FedVARP).
    cluster_of : another assignment, set in code (client id -> any integer label, one per
        client; e.g. the workload's label clusters): it replaces the blocks."""

    clusters: int = 0
    cluster_of: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clusters < 0:
            raise ValueError(f"clusters must be >= 0 (0 = one per client); got {self.clusters}")


@dataclass
class ClusterFedVARPState(StoredState):
    """The stored cluster updates, the cluster of every client and ȳ = Σ_c (N_c/N) y_c."""

    cluster_of: np.ndarray | None = None
    ybar: np.ndarray | None = None


def clusters_of(cluster_of: np.ndarray, num_clients: int) -> np.ndarray:
    """Client id -> cluster id 0..C-1 from any integer labels, one per client."""
    c = np.asarray(cluster_of)
    if c.shape != (num_clients,) or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"cluster_of must be an integer array of shape ({num_clients},); got {c.dtype} {c.shape}")
    return np.unique(c, return_inverse=True)[1].astype(np.int64)


class ClusterFedVARPRule(StoredRule):
    """ClusterFedVARP (Jhunjhunwala et al., UAI 2022, Alg. 2): one stored update per cluster.

    State y_c for C clusters (C × d float32), cluster sizes N_c:

        v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − y_{c(i)}) + Σ_c (N_c/N) y_c,   x ← x + η_g v,
        then y_c ← mean of Δ_i over A_t ∩ c (clusters without participants keep y_c).

    Clusters (``clusters`` = C): contiguous, near-equal blocks of client ids, client i in cluster
    ⌊i C / N⌋ (sizes differ by at most one; the grouping of the ``group-cyclic`` schedule).
    ``clusters=0`` (the default) makes every client its own cluster, which is FedVARP exactly
    (C = 1 would be FedAvg over the active clients). Another assignment (e.g. the workload's
    label clusters) is the parameter ``cluster_of``: ``ClusterFedVARP(num_clients=4,
    cluster_of=(7, 7, 9, 9))``. An empty round leaves the model as it is.
    """

    name = "cluster-fedvarp"
    Params, State = ClusterFedVARPParams, ClusterFedVARPState

    def validate(self, num_clients: int | None) -> None:
        if num_clients is not None and self.params.clusters > num_clients:
            raise ValueError(f"clusters={self.params.clusters} exceeds num_clients={num_clients}")
        if num_clients is not None and self.params.cluster_of:
            clusters_of(np.array(self.params.cluster_of), num_clients)

    def prepared(self, state: ClusterFedVARPState, ctx: RoundContext) -> ClusterFedVARPState:
        if state.cluster_of is None:
            n = ctx.require_num_clients()
            self.validate(n)
            cluster_of = clusters_of(np.array(self.params.cluster_of), n) if self.params.cluster_of else \
                np.arange(n, dtype=np.int64) * (self.params.clusters or n) // n
            state = replace(state, cluster_of=cluster_of)
        if state.ybar is None or state.ybar.size != ctx.x.size:
            state = replace(state, ybar=np.zeros(ctx.x.size, np.float64))  # Σ_c (N_c/N) y_c, kept up to date in O(d)
        return state

    def num_rows(self, state: ClusterFedVARPState, ctx: RoundContext) -> int:
        assert state.cluster_of is not None
        return int(state.cluster_of.max()) + 1

    def rows_of(self, state: ClusterFedVARPState, reports: list[ClientReport]) -> list[int]:
        assert state.cluster_of is not None
        return [int(state.cluster_of[r.client_id]) for r in reports]

    def forget(self, state: ClusterFedVARPState, table: ClientTable, row: int) -> None:
        """An expired cluster row leaves ȳ = Σ_c (N_c/N) y_c too."""
        cluster = state.cluster_of
        if state.ybar is not None and state.ybar.size == table.dim and cluster is not None:
            state.ybar -= (np.count_nonzero(cluster == row) / len(cluster)) * table.row(row).astype(np.float64)
        table.clear_row(row)

    def step(self, state: ClusterFedVARPState, table: ClientTable, ctx: RoundContext,
             reports: list[ClientReport]) -> Finished:
        cluster, ybar = state.cluster_of, state.ybar
        assert cluster is not None and ybar is not None
        if not reports:
            return Finished(ctx.x, state, {})
        share = np.bincount(cluster, minlength=table.num_rows) / len(cluster)  # N_c / N
        members: dict[int, list[np.ndarray]] = {}  # cluster -> the Δ_i of A_t ∩ c, in order
        for r in reports:
            members.setdefault(int(cluster[r.client_id]), []).append(r.delta)
        clusters = list(members)
        counts = [len(members[c]) for c in clusters]
        # Σ_{i∈A_t} (Δ_i − y_{c(i)}): one BLAS product over the reply rows, one over the table's
        correction = cast(np.ndarray, weighted_sum([1.0] * len(reports), (r.delta for r in reports))).astype(np.float64)
        correction -= weighted_sum(counts, [table.rows[c] for c in clusters])
        v = correction / len(reports) + ybar
        # y_c ← the mean Δ_i of A_t ∩ c (a lone member's Δ as is); ȳ += Σ_c (N_c/N)(y_c^new − y_c)
        news = [d[0] if len(d) == 1 else _mean32(d) for d in members.values()]
        added, removed = np.zeros(ctx.x.size, np.float64), np.zeros(ctx.x.size, np.float64)
        table.set_rows(clusters, news, weights=share[clusters].tolist(), fresh=added, stale=removed)
        ybar += added
        ybar -= removed
        return Finished(ctx.x + (ctx.server_lr * v).astype(np.float32), state, {"num-clusters-updated": len(members)})


class ClusterFedVARP(RuleStrategy):
    """:class:`ClusterFedVARPRule` as a Flower Strategy (Jhunjhunwala et al., UAI 2022, Alg. 2)."""

    rule = ClusterFedVARPRule()
