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
from typing import Any

import numpy as np

from ..base import ClientReport
from ..memory import StoredUpdates, TableState


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
        correction = np.zeros(x.size, np.float64)
        for r in reports:
            correction += r.delta
            correction -= table.row(r.client_id)
        v = correction / len(reports) + table.mean()
        for r in reports:
            table.set_row(r.client_id, r.delta)
        return x + (self.server_lr * v).astype(np.float32), {"num-seen": table.num_seen}


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
        correction = np.zeros(x.size, np.float64)
        sums: dict[int, np.ndarray] = {}  # Σ Δ_i over A_t ∩ c
        counts: dict[int, int] = {}
        for r in reports:
            c = int(cluster[r.client_id])
            correction -= table.row(c)
            if c not in sums:  # a lone member's Δ is used as is (no d-sized copy per client)
                sums[c], counts[c] = r.delta, 1
            else:
                if counts[c] == 1:
                    sums[c] = sums[c].astype(np.float64)
                sums[c] += r.delta
                counts[c] += 1
        for total in sums.values():
            correction += total
        v = correction / len(reports) + self.ybar
        for c, total in sums.items():
            new = np.asarray(total / counts[c], np.float32)
            self.ybar += share[c] * (new.astype(np.float64) - table.row(c))
            table.set_row(c, new)
        return x + (self.server_lr * v).astype(np.float32), {"num-clusters-updated": len(sums)}
