"""MIFA: memory-augmented impatient federated averaging.

Gu, Huang, Zhang and Liu, "Fast Federated Learning in the Presence of Arbitrary Device
Unavailability", NeurIPS 2021, Alg. 1 (MIFA): the server keeps the latest update of every client
and applies the average of ALL of them every round.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base import ClientReport, ReplyRejected
from ..memory import StoredUpdates, TableState
from ..protocol import LR, NUM_EXAMPLES
from ..replies import positive
from ..state import kept_as
from ..weighting import weighted_sum

LR_HISTORY = 64  # accepted lrs whose median is the reference


@dataclass
class MIFAState(TableState):
    """The stored updates Y, the last round's lr (gradient units) and whether all were seen."""

    last_lr: float | None = None
    filled: bool = False
    lr_history: list[float] = field(default_factory=list, metadata=kept_as(  # recently accepted lrs
        list, lambda saved, rule: deque(saved, maxlen=LR_HISTORY)))


class MIFA(StoredUpdates):
    """MIFA (Gu et al., NeurIPS 2021, Alg. 1): Y_i ← Δ_i for i ∈ A_t, u = (1/N) Σ_{i=1}^N Y_i.

    Y (N × d float32, :class:`ClientTable`, zero at start: the "no-wait" start of the FedAU and
    FedAWE code) includes stale entries; u is applied in EVERY round, empty rounds included.
    ``memory_dir`` = "" keeps Y in RAM, a folder puts it in a disk-backed memmap there.

    Options reproducing the official code:

    - ``gradient_units``: store Y_i = Δ_i / η_l,i (η_l,i the lr client i used, read from the
      reply metric ``lr``) and apply u = η_l^t · (1/N) Σ_i Y_i with η_l^t the lr of this round's
      replies (their mean; the last one seen in an empty round). A reply without ``lr`` is
      rejected with a reason saying so, and so is one whose ``lr`` is not within a factor
      ``max_lr_ratio`` (default 100) of the reference: the median of the last 64 accepted lrs,
      or before any, ``lr`` (spec key ``mifa:lr=``, the run's base lr; 0 = not given: the first
      accepted replies set the reference). Honest replies of one round share the round's lr
      (``workloads.solvers.lr_at``) and schedules change it by at most a factor 10 at once
      (``step:gamma=0.1``), so the factor 100 leaves margin; a stored Y_i = Δ_i / η_l,i then
      weighs at most 100 times what it would at the reference lr (the table keeps it).
    - ``wait_for_all``: until every client has been seen once, aggregate as FedAvg over the
      active clients (u = mean_{A_t} Δ_i; the table is filled meanwhile), then switch to MIFA.
      This APPROXIMATES the official start, which waits until all clients were seen and then
      trains all of them on one model to fill the table (not possible when clients are really
      unavailable).
    """

    name = "mifa"
    State = MIFAState

    def __init__(self, *, gradient_units: bool = False, wait_for_all: bool = False,
                 memory_dir: str = "", lr: float = 0.0, max_lr_ratio: float = 100.0, **kwargs: Any) -> None:
        super().__init__(memory_dir=memory_dir, **kwargs)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"mifa: lr (the run's base lr; 0 = not given) must be a finite number >= 0, got {lr}")
        if not (math.isfinite(max_lr_ratio) and max_lr_ratio > 1):
            raise ValueError(f"mifa: max_lr_ratio (spec key max-lr-ratio) must be a finite number > 1, "
                             f"got {max_lr_ratio}")
        self.gradient_units = bool(gradient_units)
        self.wait_for_all = bool(wait_for_all)
        self.lr, self.max_lr_ratio = float(lr), float(max_lr_ratio)
        self.lr_history: deque[float] = deque(maxlen=LR_HISTORY)
        if self.gradient_units:
            self.required_metrics = (NUM_EXAMPLES, LR)
        self.last_lr: float | None = None
        self.filled = False  # every client seen once (wait_for_all)

    def check_report(self, report: ClientReport) -> None:
        if not self.gradient_units:
            return
        try:
            lr = positive(report.metrics, LR)
        except ReplyRejected as exc:
            raise ReplyRejected(f"{exc} (strategy '{self.name}' with gradient_units needs it)") from None
        reference = float(np.median(self.lr_history)) if self.lr_history else self.lr
        if lr is None:
            raise ReplyRejected(f"the reply lacks metric '{LR}' (strategy '{self.name}' with gradient_units needs it)")
        if reference and not reference / self.max_lr_ratio <= lr <= reference * self.max_lr_ratio:
            raise ReplyRejected(f"metric '{LR}'={lr:.3g} is not within a factor max-lr-ratio {self.max_lr_ratio:g} "
                                f"of the reference lr {reference:.3g} (the median of recently accepted lrs)")

    def commit_counts(self, reports: list[ClientReport]) -> None:
        if self.gradient_units:
            self.lr_history.extend(float(r.metrics[LR]) for r in reports)

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        table = self._table(x.size, [r.client_id for r in reports])
        if self.gradient_units and reports:
            lrs = [float(r.metrics[LR]) for r in reports]
            self.last_lr = float(np.mean(lrs))
        scales = [1.0 / float(r.metrics[LR]) for r in reports] if self.gradient_units else None
        table.set_rows([r.client_id for r in reports], [r.delta for r in reports], scales)
        metrics = {"num-seen": table.num_seen}
        if self.wait_for_all and not self.filled:
            self.filled = table.num_seen == table.num_rows
            if not self.filled:
                if not reports:
                    return x, metrics
                u = weighted_sum(self.weights(reports), (r.delta for r in reports))
                return x + self.server_lr * u, metrics
        if table.num_seen == 0:
            return x, metrics
        u = table.mean()
        if self.gradient_units:
            u = u * self.last_lr
        return x + (self.server_lr * u).astype(np.float32), metrics
