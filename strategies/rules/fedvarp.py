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

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..base import ClientReport
from ..memory import ClientTable, StoredUpdates, TableState
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


class FedVARP(StoredUpdates):
    """FedVARP (Jhunjhunwala et al., UAI 2022, Alg. 1, Eq. 4).

    State y_i (client i's latest Δ_i, zero at start; N × d float32 :class:`ClientTable`, in RAM
    or in a memmap under ``memory_dir``) and ȳ = (1/N) Σ_j y_j (the table's running mean):

        v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − y_i) + ȳ,   x ← x + η_g v,   then y_i ← Δ_i (i ∈ A_t).

    ȳ is the mean as of the end of the previous round. An empty round leaves the model as it is
    (see the module docstring).
    """

    name = "fedvarp"

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        table = self._table(x.size, [r.client_id for r in reports])
        if not reports:
            return x, {"num-seen": table.num_seen}
        return stale_step(table, x, reports, 1.0, self.server_lr), {"num-seen": table.num_seen}


def _mean32(deltas: list[np.ndarray]) -> np.ndarray:
    """The mean of float32 vectors, summed in float64, as float32."""
    total = deltas[0].astype(np.float64)
    for delta in deltas[1:]:
        total += delta
    return (total / len(deltas)).astype(np.float32)


@dataclass
class ClusterFedVARPState(TableState):
    """The stored cluster updates, the cluster of every client and ȳ = Σ_c (N_c/N) y_c."""

    cluster_of: np.ndarray | None = None
    ybar: np.ndarray | None = None


class ClusterFedVARP(StoredUpdates):
    """ClusterFedVARP (Jhunjhunwala et al., UAI 2022, Alg. 2): one stored update per cluster.

    State y_c for C clusters (C × d float32), cluster sizes N_c:

        v = (1/|A_t|) Σ_{i∈A_t} (Δ_i − y_{c(i)}) + Σ_c (N_c/N) y_c,   x ← x + η_g v,
        then y_c ← mean of Δ_i over A_t ∩ c (clusters without participants keep y_c).

    Clusters (``clusters`` = C): contiguous, near-equal blocks of client ids, client i in cluster
    ⌊i C / N⌋ (sizes differ by at most one; the grouping of the ``group-cyclic`` schedule).
    ``clusters=0`` (the default) makes every client its own cluster, which is FedVARP exactly
    (C = 1 would be FedAvg over the active clients). Another assignment (e.g. the workload's
    label clusters) can be set in code with :meth:`set_clusters` before the first round.
    An empty round leaves the model as it is.
    """

    name = "cluster-fedvarp"
    State = ClusterFedVARPState

    def __init__(self, *, clusters: int = 0, memory_dir: str = "", **kwargs: Any) -> None:
        super().__init__(memory_dir=memory_dir, **kwargs)
        if clusters < 0:
            raise ValueError(f"clusters must be >= 0 (0 = one per client); got {clusters}")
        if self.num_clients is not None and clusters > self.num_clients:
            raise ValueError(f"clusters={clusters} exceeds num_clients={self.num_clients}")
        self.clusters = int(clusters)
        self.cluster_of: np.ndarray | None = None
        self.ybar: np.ndarray | None = None

    def set_clusters(self, cluster_of: np.ndarray) -> None:
        """Client id -> cluster id (any integers, one per client), replacing the blocks."""
        c = np.asarray(cluster_of)
        n = self.require_num_clients()
        if c.shape != (n,) or not np.issubdtype(c.dtype, np.integer):
            raise ValueError(f"cluster_of must be an integer array of shape ({n},); got {c.dtype} {c.shape}")
        if self.table is not None:
            raise RuntimeError("set_clusters after the first round would mix cluster memories")
        self.cluster_of = np.unique(c, return_inverse=True)[1].astype(np.int64)

    def _assignment(self) -> np.ndarray:
        if self.cluster_of is None:
            n = self.require_num_clients()
            c = self.clusters or n
            self.cluster_of = np.arange(n, dtype=np.int64) * c // n
        return self.cluster_of

    def num_rows(self) -> int:
        return int(self._assignment().max()) + 1

    def forget_row(self, table, row: int) -> None:
        """An expired cluster row leaves ȳ = Σ_c (N_c/N) y_c too."""
        if self.ybar is not None and self.ybar.size == table.dim:
            cluster = self._assignment()
            self.ybar -= (np.count_nonzero(cluster == row) / len(cluster)) * table.row(row).astype(np.float64)
        table.clear_row(row)

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        cluster = self._assignment()
        table = self._table(x.size, [int(cluster[r.client_id]) for r in reports])
        if self.ybar is None or self.ybar.size != x.size:
            self.ybar = np.zeros(x.size, np.float64)  # Σ_c (N_c/N) y_c, kept up to date in O(d)
        if not reports:
            return x, {}
        share = np.bincount(cluster, minlength=table.num_rows) / len(cluster)  # N_c / N
        members: dict[int, list[np.ndarray]] = {}  # cluster -> the Δ_i of A_t ∩ c, in order
        for r in reports:
            members.setdefault(int(cluster[r.client_id]), []).append(r.delta)
        clusters = list(members)
        counts = [len(members[c]) for c in clusters]
        # Σ_{i∈A_t} (Δ_i − y_{c(i)}): one BLAS product over the reply rows, one over the table's
        correction = cast(np.ndarray, weighted_sum([1.0] * len(reports), (r.delta for r in reports))).astype(np.float64)
        correction -= weighted_sum(counts, [table.rows[c] for c in clusters])
        v = correction / len(reports) + self.ybar
        # y_c ← the mean Δ_i of A_t ∩ c (a lone member's Δ as is); ȳ += Σ_c (N_c/N)(y_c^new − y_c)
        news = [d[0] if len(d) == 1 else _mean32(d) for d in members.values()]
        added, removed = np.zeros(x.size, np.float64), np.zeros(x.size, np.float64)
        table.set_rows(clusters, news, weights=share[clusters].tolist(), fresh=added, stale=removed)
        self.ybar += added
        self.ybar -= removed
        return x + (self.server_lr * v).astype(np.float32), {"num-clusters-updated": len(members)}
