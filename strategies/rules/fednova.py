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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..bounds import MAX_STEPS_RATIO, RatioBound
from ..contract import Finished, Needs, RoundContext, Rule
from ..protocol import A_NORM, NUM_EXAMPLES, NUM_STEPS
from ..replies import ClientReport, ReplyRejected
from ..rule_strategy import RuleStrategy
from ..state import kept_as
from ..streaming import RunningSum, step

NEEDS_A_NORM = (
    "FedNova needs the 'a-norm' metric (‖a_i‖_1 of the local solver: the number of local steps "
    "for plain SGD; workloads.solvers.a_norm for momentum and FedProx) in every training reply: "
    "add it to the ClientApp's train reply MetricRecord"
)
NEEDS_NUM_STEPS = (
    "FedNova needs the 'num-steps' metric (τ_i, the local steps the client ran) in every training "
    "reply: its 'a-norm' is checked against what τ_i steps can produce"
)


@dataclass(frozen=True)
class FedNovaParams:
    """server_momentum : β of the server momentum (0: none); max_a_norm_ratio : ‖a_i‖_1 at most
    this × τ_i; max_steps_ratio : τ_i and ‖a_i‖_1 at most this × the lower median of the nodes'
    recent ones (0 = off)."""

    server_momentum: float = 0.0
    max_a_norm_ratio: float = 10.0
    max_steps_ratio: float = MAX_STEPS_RATIO

    def __post_init__(self) -> None:
        ratio = self.max_steps_ratio
        if not (math.isfinite(ratio) and (ratio == 0 or ratio > 1)):
            raise ValueError(f"max_steps_ratio (spec key max-steps-ratio) must be a finite number > 1 (0 = off), "
                             f"got {ratio}")
        if not 0.0 <= self.server_momentum < 1.0:
            raise ValueError(f"server_momentum must be in [0, 1), got {self.server_momentum}")
        if not (math.isfinite(self.max_a_norm_ratio) and self.max_a_norm_ratio >= 1):
            raise ValueError(f"max_a_norm_ratio (spec key max-a-norm-ratio) must be a finite number >= 1, "
                             f"got {self.max_a_norm_ratio}")


def _reference() -> RatioBound:
    return RatioBound(0.0)  # entries only: the rule applies max_steps_ratio to its reference


def _loaded(saved: Any, rule: Any) -> RatioBound:
    bound = _reference()
    bound.load_state_dict(saved)
    return bound


@dataclass
class FedNovaState:
    """The server momentum buffer v (None before the first round or without momentum) and the
    recent accepted τ_i and ‖a_i‖_1 (the references of ``max_steps_ratio``; checkpointed as their
    ``state_dict()``)."""

    buffer: np.ndarray | None = None
    steps_bound: RatioBound = field(default_factory=_reference, metadata=kept_as(RatioBound.state_dict, _loaded))
    a_norm_bound: RatioBound = field(default_factory=_reference, metadata=kept_as(RatioBound.state_dict, _loaded))


class FedNovaRule(Rule):
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
    Params, State = FedNovaParams, FedNovaState
    # p_i = n_i / n (Wang et al. 2020, Eq. 7); the robust stage: τ_eff × the statistic of Δ_i / a_i
    needs = Needs(paper_weighting="num-examples", mean_of_updates=True, metrics=(NUM_EXAMPLES, A_NORM, NUM_STEPS),
                  metric_hints={A_NORM: NEEDS_A_NORM, NUM_STEPS: NEEDS_NUM_STEPS})

    def check(self, state: FedNovaState, report: ClientReport) -> None:
        """‖a_i‖_1 within [1, max_a_norm_ratio · τ_i] (the class docstring says why)."""
        a, tau, ratio = report.a_norm, report.num_steps, self.params.max_a_norm_ratio
        assert a is not None and tau is not None  # required metrics
        if not 1.0 <= a <= ratio * tau:
            raise ReplyRejected(f"metric '{A_NORM}'={a:.3g} is outside [1, max-a-norm-ratio {ratio:g} "
                                f"x num-steps {tau}]: no local solver gives it")

    def check_round(self, state: FedNovaState, reports: list[ClientReport],
                    reject: Callable[[int, str], None]) -> list[ClientReport]:
        """τ_i and ‖a_i‖_1 within ``max_steps_ratio`` × the lower median over nodes of each node's
        latest accepted one (:class:`RatioBound`: one entry per client identity; the first round's own), so
        that no client inflates τ_eff (which scales every client's normalised update) by more than
        that factor (the norm bounds come next)."""
        ratio = float(self.params.max_steps_ratio)
        checks: tuple[tuple[str, RatioBound, Callable[[ClientReport], float]], ...] = (
            ("num-steps", state.steps_bound, lambda r: float(r.num_steps or 0)),
            ("a-norm", state.a_norm_bound, lambda r: float(r.a_norm or 0.0)))
        for name, bound, value_of in checks:
            ref = bound.reference({r.client_id: value_of(r) for r in reports})
            limit = ratio * ref if ratio and ref is not None else math.inf
            for r in reports:
                if value_of(r) > limit:
                    reject(r.node_id, f"metric '{name}'={value_of(r):.3g} > max-steps-ratio "
                                      f"{ratio:g} x the median of recent ones {limit / ratio:.3g}")
            reports = [r for r in reports if value_of(r) <= limit]
        return reports

    def accepted(self, state: FedNovaState, reports: list[ClientReport]) -> FedNovaState:
        """The references with the round's accepted τ_i and ‖a_i‖_1 (one entry per client identity)."""
        steps, a_norm = _reference(), _reference()
        steps.entries, a_norm.entries = OrderedDict(state.steps_bound.entries), OrderedDict(state.a_norm_bound.entries)
        steps.commit({r.client_id: float(r.num_steps) for r in reports if r.num_steps is not None})
        a_norm.commit({r.client_id: float(r.a_norm) for r in reports if r.a_norm is not None})
        return replace(state, steps_bound=steps, a_norm_bound=a_norm)

    def references(self, state: FedNovaState) -> tuple[RatioBound, ...]:
        return state.steps_bound, state.a_norm_bound

    def fold(self, state: FedNovaState, ctx: RoundContext) -> FedNovaFold:
        return FedNovaFold(self.params.server_momentum, state, ctx)

    def robust_round(self, state: FedNovaState, ctx: RoundContext, reports: list[ClientReport],
                     combine: Callable[[list[np.ndarray]], np.ndarray]) -> Finished:
        """``robust=median`` / ``trimmed-mean``: τ_eff and the normalised updates Δ_i / a_i, each by
        the robust statistic."""
        if any(r.a_norm is None for r in reports):
            raise ValueError(NEEDS_A_NORM)
        a = np.array([r.a_norm for r in reports], np.float64)
        tau_eff = float(combine([np.array([ai], np.float32) for ai in a])[0])
        u = tau_eff * combine([r.delta / np.float32(ai) for r, ai in zip(reports, a, strict=True)]).astype(np.float64)
        v, state = momentum(self.params.server_momentum, state, u)
        return Finished(step(ctx.x, ctx.server_lr, v), state, {"tau-eff": tau_eff})


def momentum(beta: float, state: FedNovaState, u: np.ndarray) -> tuple[np.ndarray, FedNovaState]:
    """v ← β v + u (server momentum β) and the state holding it; u itself without momentum."""
    if beta > 0:
        v = u if state.buffer is None else beta * state.buffer + u
        return v, replace(state, buffer=v)
    return u, state


class FedNovaFold:
    """FedNova's update folded in reply by reply, with unnormalised weights v_i (``ctx.weight``:
    n_i, or 1, or the held round's weights) and W = Σ v_i: τ_eff = Σ v_i a_i / W and
    Σ p_i Δ_i / a_i = (Σ (v_i / a_i) Δ_i) / W."""

    def __init__(self, beta: float, state: FedNovaState, ctx: RoundContext) -> None:
        self.beta, self.state, self.ctx = beta, state, ctx
        self.sum = RunningSum(ctx.x.size)
        self.work = 0.0  # Σ v_i a_i
        self.weight = 0.0  # Σ v_i

    def add(self, report: ClientReport) -> None:
        if report.a_norm is None:
            raise ValueError(NEEDS_A_NORM)
        v, a = self.ctx.weight(report), float(report.a_norm)
        self.sum.add(v / a, report.delta)
        self.work += v * a
        self.weight += v

    def finish(self) -> Finished:
        if not self.sum.count:
            return Finished(self.ctx.x, self.state, {})
        tau_eff = self.work / self.weight
        v, state = momentum(self.beta, self.state, (tau_eff / self.weight) * self.sum.total)
        return Finished(step(self.ctx.x, self.ctx.server_lr, v), state, {"tau-eff": tau_eff})


class FedNova(RuleStrategy):
    """:class:`FedNovaRule` as a Flower Strategy (Wang et al., NeurIPS 2020, Eq. 7)."""

    rule = FedNovaRule()
