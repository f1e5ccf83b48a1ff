"""MIFA: memory-augmented impatient federated averaging.

Gu, Huang, Zhang and Liu, "Fast Federated Learning in the Presence of Arbitrary Device
Unavailability", NeurIPS 2021, Alg. 1 (MIFA): the server keeps the latest update of every client
and applies the average of ALL of them every round.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..contract import Finished, RoundContext
from ..memory import ClientTable, StoredParams, StoredRule, StoredState
from ..protocol import LR, NUM_EXAMPLES
from ..replies import ClientReport, ReplyRejected, positive
from ..rule_strategy import RuleStrategy
from ..state import kept_as
from ..weighting import weighted_sum

LR_HISTORY = 64  # accepted lrs whose median is the reference


@dataclass(frozen=True)
class MIFAParams(StoredParams):
    """gradient_units, wait_for_all, lr, max_lr_ratio: :class:`MIFARule`'s options."""

    gradient_units: bool = False
    wait_for_all: bool = False
    lr: float = 0.0
    max_lr_ratio: float = 100.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"mifa: lr (the run's base lr; 0 = not given) must be a finite number >= 0, got {self.lr}")
        if not (math.isfinite(self.max_lr_ratio) and self.max_lr_ratio > 1):
            raise ValueError(f"mifa: max_lr_ratio (spec key max-lr-ratio) must be a finite number > 1, "
                             f"got {self.max_lr_ratio}")


@dataclass
class MIFAState(StoredState):
    """The stored updates Y, the last round's lr (gradient units) and whether all were seen."""

    last_lr: float | None = None
    filled: bool = False
    lr_history: deque[float] = field(default_factory=lambda: deque(maxlen=LR_HISTORY), metadata=kept_as(
        list, lambda saved, rule: deque(saved, maxlen=LR_HISTORY)))  # recently accepted lrs


class MIFARule(StoredRule):
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
    Params, State = MIFAParams, MIFAState

    def __init__(self, params: MIFAParams | None = None) -> None:
        super().__init__(params)
        if self.params.gradient_units:  # every reply carries its lr
            self.needs = replace(StoredRule.needs, metrics=(NUM_EXAMPLES, LR))

    def check(self, state: MIFAState, report: ClientReport) -> None:
        if not self.params.gradient_units:
            return
        try:
            lr = positive(report.metrics, LR)
        except ReplyRejected as exc:
            raise ReplyRejected(f"{exc} (strategy '{self.name}' with gradient_units needs it)") from None
        reference = float(np.median(state.lr_history)) if state.lr_history else self.params.lr
        if lr is None:
            raise ReplyRejected(f"the reply lacks metric '{LR}' (strategy '{self.name}' with gradient_units needs it)")
        ratio = self.params.max_lr_ratio
        if reference and not reference / ratio <= lr <= reference * ratio:
            raise ReplyRejected(f"metric '{LR}'={lr:.3g} is not within a factor max-lr-ratio {ratio:g} "
                                f"of the reference lr {reference:.3g} (the median of recently accepted lrs)")

    def accepted(self, state: MIFAState, reports: list[ClientReport]) -> MIFAState:
        if self.params.gradient_units:
            state.lr_history.extend(float(r.metrics[LR]) for r in reports)
        return state

    def step(self, state: MIFAState, table: ClientTable, ctx: RoundContext, reports: list[ClientReport]) -> Finished:
        x, p = ctx.x, self.params
        if p.gradient_units and reports:
            state = replace(state, last_lr=float(np.mean([float(r.metrics[LR]) for r in reports])))
        scales = [1.0 / float(r.metrics[LR]) for r in reports] if p.gradient_units else None
        table.set_rows([r.client_id for r in reports], [r.delta for r in reports], scales)
        metrics: dict[str, float] = {"num-seen": table.num_seen}
        if p.wait_for_all and not state.filled:
            state = replace(state, filled=table.num_seen == table.num_rows)
            if not state.filled:
                if not reports:
                    return Finished(x, state, metrics)
                u = weighted_sum([ctx.weight(r) for r in reports], (r.delta for r in reports))
                return Finished(x + ctx.server_lr * u, state, metrics)
        if table.num_seen == 0:
            return Finished(x, state, metrics)
        u = table.mean()
        if p.gradient_units:
            assert state.last_lr is not None
            u = u * state.last_lr
        return Finished(x + (ctx.server_lr * u).astype(np.float32), state, metrics)


class MIFA(RuleStrategy):
    """:class:`MIFARule` as a Flower Strategy (Gu et al., NeurIPS 2021, Alg. 1)."""

    rule = MIFARule()
