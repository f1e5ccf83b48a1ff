"""FedNova: normalised averaging for heterogeneous local work.

Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020, Eq. (7) and Sec. 4. Client i runs τ_i local
steps and reports its change Δ_i and ‖a_i‖_1, the sum of the coefficients with which its local
gradients enter Δ_i (τ_i for plain SGD; closed forms for local momentum and FedProx in
``workloads.solvers.a_norm``; our ClientApp sends it as the ``a-norm`` metric). With p_i the
client weights renormalised over the participants A_t,

    τ_eff = Σ_{i∈A_t} p_i ‖a_i‖_1,    x^{t+1} = x^t + η_g τ_eff Σ_{i∈A_t} p_i Δ_i / ‖a_i‖_1.

Plain FedAvg weights client i by the work it did (≈ τ_i), so with heterogeneous τ_i it converges
to a different objective; dividing each Δ_i by ‖a_i‖_1 removes that bias.

Optional server momentum (the official code's ``gmf``): v ← β v + u, x ← x + η_g v, u the
normalised update above (v starts at 0, so the first step is u).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base import AvailabilityStrategy, ClientReport, ReplyRejected
from ..bounds import MAX_STEPS_RATIO, RatioBound
from ..intake import RoundIntake
from ..protocol import A_NORM, NUM_EXAMPLES, NUM_STEPS
from ..state import kept_as
from ..streaming import Fold, RunningSum, example_weight, step

NEEDS_A_NORM = (
    "FedNova needs the 'a-norm' metric (‖a_i‖_1 of the local solver: the number of local steps "
    "for plain SGD; workloads.solvers.a_norm for momentum and FedProx) in every training reply: "
    "add it to the ClientApp's train reply MetricRecord"
)
NEEDS_NUM_STEPS = (
    "FedNova needs the 'num-steps' metric (τ_i, the local steps the client ran) in every training "
    "reply: its 'a-norm' is checked against what τ_i steps can produce"
)


@dataclass
class FedNovaState:
    """The server momentum buffer v (None before the first round or without momentum) and the
    recent accepted τ_i and ‖a_i‖_1 (the references of ``max_steps_ratio``)."""

    buffer: np.ndarray | None = None
    steps_bound: dict[str, list[Any]] = field(default_factory=dict, metadata=kept_as(
        lambda bound: bound.state_dict(), lambda saved, rule: rule.steps_bound.restored(saved)))
    a_norm_bound: dict[str, list[Any]] = field(default_factory=dict, metadata=kept_as(
        lambda bound: bound.state_dict(), lambda saved, rule: rule.a_norm_bound.restored(saved)))


class FedNova(AvailabilityStrategy):
    """Normalised averaging (Wang et al., NeurIPS 2020, Eq. 7).

    p_i = n_i / n (``paper_weighting = "num-examples"``, what ``weighting="auto"``, the default,
    resolves to; ``weighting="equal"`` gives p_i = 1/|A_t|). Replies without ``a-norm`` are
    rejected with :data:`NEEDS_A_NORM` as the logged reason.

    Every number the rule divides or multiplies by is bounded by what an honest client can send:
    ``num-steps`` τ_i is required, and ``a-norm`` must lie in [1, ``max_a_norm_ratio`` · τ_i].
    The local solvers give (``workloads.solvers.a_norm``) ‖a‖_1 = τ for SGD,
    [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ) ∈ [1, τ/(1 − ρ)) for local momentum ρ, and
    [1 − (1 − η_l μ)^τ]/(η_l μ) ∈ [1, τ] for FedProx with η_l μ ≤ 1: so [1, 10 τ] (the default
    ``max_a_norm_ratio = 10``) holds every solver up to momentum 0.9 (the paper's), and
    ``fednova:max-a-norm-ratio=100`` admits momentum 0.99. With every a_i in that range, no
    client's normalised update is scaled by more than τ_eff / a_i ≤ 10 · max τ.
    """

    name = "fednova"
    required_metrics = (NUM_EXAMPLES, A_NORM, NUM_STEPS)
    metric_hints = {A_NORM: NEEDS_A_NORM, NUM_STEPS: NEEDS_NUM_STEPS}
    paper_weighting = "num-examples"  # p_i = n_i / n (Wang et al. 2020, Eq. 7)
    mean_of_updates = True  # τ_eff × the robust statistic of the normalised updates Δ_i / a_i
    State = FedNovaState
    streams = True

    def __init__(self, *, server_momentum: float = 0.0, max_a_norm_ratio: float = 10.0,
                 max_steps_ratio: float = MAX_STEPS_RATIO, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (math.isfinite(max_steps_ratio) and (max_steps_ratio == 0 or max_steps_ratio > 1)):
            raise ValueError(f"max_steps_ratio (spec key max-steps-ratio) must be a finite number > 1 (0 = off), "
                             f"got {max_steps_ratio}")
        self.steps_bound = RatioBound(float(max_steps_ratio))  # τ_i against the lower median of the nodes' latest τ
        self.a_norm_bound = RatioBound(float(max_steps_ratio))  # ‖a_i‖_1 likewise
        if not 0.0 <= server_momentum < 1.0:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}")
        if not (math.isfinite(max_a_norm_ratio) and max_a_norm_ratio >= 1):
            raise ValueError(f"max_a_norm_ratio (spec key max-a-norm-ratio) must be a finite number >= 1, "
                             f"got {max_a_norm_ratio}")
        self.server_momentum = float(server_momentum)
        self.max_a_norm_ratio = float(max_a_norm_ratio)
        self.buffer: np.ndarray | None = None  # server momentum v

    def check_report(self, report: ClientReport) -> None:
        """‖a_i‖_1 within [1, max_a_norm_ratio · τ_i] (the class docstring says why)."""
        a, tau = report.a_norm, report.num_steps
        assert a is not None and tau is not None  # required metrics
        if not 1.0 <= a <= self.max_a_norm_ratio * tau:
            raise ReplyRejected(f"metric '{A_NORM}'={a:.3g} is outside [1, max-a-norm-ratio {self.max_a_norm_ratio:g} "
                                f"x num-steps {tau}]: no local solver gives it")

    def check_counts(self, rnd: RoundIntake, reports: list[ClientReport]) -> list[ClientReport]:
        """τ_i and ‖a_i‖_1 within ``max_steps_ratio`` × the lower median over nodes of each node's
        latest accepted one (:class:`RatioBound`: one entry per node; the first round's own), so that no client inflates τ_eff (which scales every client's
        normalised update) by more than that factor (the norm bounds come next)."""
        checks: tuple[tuple[str, RatioBound, Callable[[ClientReport], float]], ...] = (
            ("num-steps", self.steps_bound, lambda r: float(r.num_steps or 0)),
            ("a-norm", self.a_norm_bound, lambda r: float(r.a_norm or 0.0)))
        for name, bound, value_of in checks:
            limit = bound.limit({r.node_id: value_of(r) for r in reports})
            for r in reports:
                if value_of(r) > limit:
                    rnd.reject(r.node_id, f"metric '{name}'={value_of(r):.3g} > max-steps-ratio "
                                           f"{bound.ratio:g} x the median of recent ones {limit / bound.ratio:.3g}")
            reports = [r for r in reports if value_of(r) <= limit]
        return reports

    def commit_counts(self, reports: list[ClientReport]) -> None:
        self.steps_bound.commit({r.node_id: float(r.num_steps) for r in reports if r.num_steps is not None})
        self.a_norm_bound.commit({r.node_id: float(r.a_norm) for r in reports if r.a_norm is not None})

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, Any]]:
        """``robust=median`` / ``trimmed-mean``: τ_eff and the normalised updates Δ_i / a_i, each by
        the robust statistic (every reply at once); else the fold (:class:`FedNovaFold`)."""
        if not self.robust.combines or not reports:
            return super().aggregate(t, x, reports)
        if any(r.a_norm is None for r in reports):
            raise ValueError(NEEDS_A_NORM)
        a = np.array([r.a_norm for r in reports], np.float64)
        tau_eff = float(self.robust.combine(a[:, None].astype(np.float32))[0])
        normalised = [r.delta / np.float32(ai) for r, ai in zip(reports, a, strict=True)]
        u = tau_eff * self.robust.combine(self.stacked("robust", normalised)).astype(np.float64)
        return step(x, self.server_lr, self.momentum(u)), {"tau-eff": tau_eff}

    def momentum(self, u: np.ndarray) -> np.ndarray:
        """v ← β v + u (server momentum β), returned; u itself without momentum."""
        if self.server_momentum > 0:
            self.buffer = u if self.buffer is None else self.server_momentum * self.buffer + u
            return self.buffer
        return u

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return FedNovaFold(self, x)


class FedNovaFold(Fold):
    """FedNova's update folded in reply by reply, with unnormalised weights v_i (n_i, or 1, or the
    held round's weights: :meth:`strategies.streaming.Fold.report_weight`) and W = Σ v_i: τ_eff = Σ v_i a_i / W and Σ p_i Δ_i / a_i = (Σ (v_i / a_i) Δ_i) / W."""

    def __init__(self, rule: FedNova, x: np.ndarray) -> None:
        self.rule, self.x = rule, x
        self.weight_of = example_weight(rule.weighting)
        self.sum = RunningSum(x.size)
        self.work = 0.0  # Σ v_i a_i
        self.weight = 0.0  # Σ v_i

    def add(self, report: ClientReport) -> None:
        if report.a_norm is None:
            raise ValueError(NEEDS_A_NORM)
        v, a = self.report_weight(report, self.weight_of), float(report.a_norm)
        self.sum.add(v / a, report.delta)
        self.work += v * a
        self.weight += v

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        if not self.sum.count:
            return self.x, {}
        tau_eff = self.work / self.weight
        u = (tau_eff / self.weight) * self.sum.total
        return step(self.x, self.rule.server_lr, self.rule.momentum(u)), {"tau-eff": tau_eff}
