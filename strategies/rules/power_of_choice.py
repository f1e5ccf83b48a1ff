"""Power-of-choice client selection: train the clients whose loss is largest.

Cho, Wang and Joshi, "Towards Understanding Biased Client Selection in Federated Learning",
AISTATS 2022, Alg. 1 (pow-d) and Sec. 5 (cpow-d, rpow-d). Each round:

1. draw d candidates without replacement, with probability ∝ data size n_i (uniform while no
   size is known; a node whose size is not known yet gets the mean known size);
2. send them the current global model in an EVALUATE probe and read their local loss
   (``pow-d``: on all local data; ``cpow-d``: on one seeded mini-batch, config
   ``probe-batches`` = 1); ``rpow-d`` sends no probe and uses the train loss each client reported
   the last time it trained (never-seen clients first);
3. send training to the m candidates with the largest loss; aggregate as FedAvg over the clients
   that replied (equal or data-size weights, as the base's ``weighting``).

d = m is plain random selection.

Hostile losses (a deviation from the paper, only beyond the honest spread): a loss above
``max_loss_ratio`` (spec key ``max-loss-ratio``, default 100; 0 = off, the paper's ranking) times
the lower median of the round's finite losses (at least 3 of them) is not credible: that
candidate ranks after every credible one (metrics ``losses-out-of-range`` and ``loss-ratio-max``,
the largest loss over that median), so a client reporting 1e308 is not picked while m credible
candidates answered. A client reporting the top loss within the bound is still picked whenever
it is a candidate (docs/threat-model.md). The generator is the strategy's seeded one (``ctx.rng``), drawn
afresh every round (the official code re-seeded it on every call, so its candidates repeated).

Unavailability: candidates are drawn among the CONNECTED nodes; one that is offline in this round
never answers the probe (the availability layer drops it) and is not chosen, so fewer than m may
train. Under rpow-d an offline candidate is chosen blindly and simply does not reply.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..bounds import MIN_POOL, lower_median
from ..contract import Finished, Needs, ProbeAnswers, RoundContext, Rule, Selection
from ..intake import Probe
from ..metrics import names
from ..protocol import EVAL_LOSS, PROBE_BATCHES, TRAIN_LOSS
from ..replies import ClientReport, ReplyRejected, finite
from ..rule_strategy import RuleStrategy
from ..sampling import draw
from ..weighting import weighted_sum

VARIANTS = ("pow-d", "cpow-d", "rpow-d")
MAX_LOSS_RATIO = 100.0  # x the lower median of the round's probe losses (module docstring)
flwr_log = logging.getLogger("flwr")


@dataclass(frozen=True)
class PowerOfChoiceParams:
    """d : candidates drawn; m : of them trained (capped to d, said); variant : one of
    :data:`VARIANTS`; probe_timeout : seconds the probe waits; max_loss_ratio : the credible loss
    bound (module docstring; 0 = off)."""

    d: int = 10
    m: int = 5
    variant: str = "pow-d"
    probe_timeout: float = 60.0
    max_loss_ratio: float = MAX_LOSS_RATIO

    def __post_init__(self) -> None:
        ratio, d, m = self.max_loss_ratio, self.d, self.m
        if not (math.isfinite(ratio) and (ratio == 0 or ratio > 1)):
            raise ValueError(f"pow-d: max_loss_ratio (spec key max-loss-ratio) must be a finite number > 1 "
                             f"(0 = off), got {ratio}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if not (isinstance(d, int) and isinstance(m, int) and d >= 1 and m >= 1):
            raise ValueError(f"pow-d needs integers d >= 1 and m >= 1, got d={d!r}, m={m!r}")
        if m > d:
            flwr_log.warning("pow-d: m=%d > d=%d: m capped to d=%d (every candidate trains)", m, d, d)
            object.__setattr__(self, "m", d)
        if not self.probe_timeout > 0:
            raise ValueError(f"probe_timeout must be > 0, got {self.probe_timeout}")


@dataclass
class PowerOfChoiceState:
    """Client id -> its data size (from any reply) and -> its train loss when it last trained; the
    connected count of the last "capped" note (None: none said)."""

    size_of: dict[int, int] = field(default_factory=dict)
    last_loss: dict[int, float] = field(default_factory=dict)
    capped_at: int | None = None


class PowerOfChoiceRule(Rule):
    """Loss-biased client selection (Cho et al., AISTATS 2022, Alg. 1)."""

    name = "pow-d"
    Params, State = PowerOfChoiceParams, PowerOfChoiceState
    needs = Needs(mean_of_updates=True, holds="its update reads every reply of the round at once", fixed_selection=(
        "power-of-choice chooses its own clients each round (d candidates probed, the m "
        "with the largest loss trained): set d and m instead"))

    # ------------------------------------------------------------------ selection
    def probe(self, state: PowerOfChoiceState, ctx: RoundContext, connected: list[int]) -> Probe:
        """d candidates drawn among the connected nodes, ∝ known data size (uniform while none is
        known); pow-d and cpow-d probe them (``probe-batches`` 1 for cpow-d, 0 = all local data),
        rpow-d does not."""
        assert ctx.rng is not None
        p = self.params
        k = min(p.d, len(connected))
        sizes = np.array([state.size_of.get(ctx.client_of_node.get(n, -1), np.nan) for n in connected], np.float64)
        weights = None
        if k < len(connected) and not np.all(np.isnan(sizes)):
            sizes[np.isnan(sizes)] = np.nanmean(sizes)
            weights = sizes / sizes.sum()
        return Probe(draw(connected, k, ctx.rng, weights), {PROBE_BATCHES: 1 if p.variant == "cpow-d" else 0},
                     p.probe_timeout, send=p.variant != "rpow-d")

    def select(self, state: PowerOfChoiceState, ctx: RoundContext, connected: list[int], probe: Probe | None,
               answers: ProbeAnswers) -> Selection:
        """Train the m candidates (:meth:`probe`) with the largest loss: the probe's (pow-d,
        cpow-d) or the last train loss (rpow-d); d and m capped by the connected nodes, with a
        logged note each time their number below d changes (the defaults d=10, m=5 then fit a
        small federation)."""
        p, n = self.params, len(connected)
        if p.d > n and n != state.capped_at:
            flwr_log.info("pow-d: %d node(s) connected: d=%d capped to %d, m=%d to %d", n, p.d, min(p.d, n),
                          p.m, min(p.m, n))
        state = replace(state, capped_at=n if p.d > n else None, size_of=dict(state.size_of))
        candidates = probe.nodes if probe is not None else []
        problems: list[str] = []
        if p.variant == "rpow-d":
            losses = {c: state.last_loss.get(ctx.client_of_node.get(c, c), math.inf) for c in candidates}
        else:
            losses = self.read_probe(ctx.t + 1, state, candidates, answers, problems)
        chosen, loss_check = self.choose(candidates, losses)
        return Selection(chosen, state, {
            **loss_check,
            "candidates": len(candidates),
            "probe-replies": len(losses) if p.variant != "rpow-d" else 0,
            "chosen-clients": [int(ctx.client_of_node.get(c, c)) for c in chosen],
            # rpow-d: a never-seen client's loss is unknown, written -1
            "chosen-losses": [losses[c] if math.isfinite(losses[c]) else -1.0 for c in chosen],
        }, tuple(problems))

    def read_probe(self, server_round: int, state: PowerOfChoiceState, candidates: list[int],
                   answers: ProbeAnswers, problems: list[str]) -> dict[int, float]:
        """Node -> local loss of the current model, for the candidates that answered the probe
        in time; a bad value is ignored, not trusted. Each answer's client id and data size are
        claims (``answers.claim``, ``answers.examples``), the size kept in ``state.size_of``."""
        losses: dict[int, float] = {}
        for node, metrics in answers.metrics.items():
            try:  # the same readers as training replies
                loss = finite(metrics, EVAL_LOSS)
            except ReplyRejected:
                continue
            if loss is None:
                continue
            losses[node] = loss
            client = answers.claim(node, metrics)
            size = answers.examples(metrics, [float(v) for v in state.size_of.values()])
            if size is not None:
                state.size_of[client] = size
        if candidates and not answers.metrics:  # unavailability, or a probe_timeout too short for cold clients
            flwr_log.warning("pow-d, round %d: none of %d candidates answered the probe within "
                             "probe-timeout=%gs; nobody trains this round", server_round, len(candidates),
                             self.params.probe_timeout)
        if answers.metrics and not losses:  # the rule cannot choose: fail the run rather than train nobody
            problems.append(f"power-of-choice's probe got {len(answers.metrics)} evaluate replies, none with a "
                            f"loss {names(EVAL_LOSS)}: add it to the ClientApp's evaluate reply")
        return losses

    def choose(self, candidates: list[int], losses: dict[int, float]) -> tuple[list[int], dict[str, float]]:
        """The m candidates with the largest credible loss (ties keep the random draw order) and
        the loss bound's metrics; a loss beyond ``max_loss_ratio`` × the lower median of the
        finite ones ranks last."""
        finite = [v for v in losses.values() if math.isfinite(v)]
        reference = lower_median(finite) if len(finite) >= MIN_POOL else 0.0
        ratio = self.params.max_loss_ratio
        limit = ratio * reference if ratio and reference > 0 else math.inf
        out = [n for n in candidates if n in losses and math.isfinite(losses[n]) and losses[n] > limit]
        loss_check = {"losses-out-of-range": len(out),
                      **({"loss-ratio-max": max(finite) / reference} if reference > 0 else {})}
        ranked = sorted((n for n in candidates if n in losses), key=lambda n: (n in out, -losses[n]))
        return ranked[: self.params.m], loss_check

    # ------------------------------------------------------------------ aggregation
    def fold(self, state: PowerOfChoiceState, ctx: RoundContext) -> PowerOfChoiceFold:
        return PowerOfChoiceFold(self.params.variant, state, ctx)

    def robust_round(self, state: PowerOfChoiceState, ctx: RoundContext, reports: list[ClientReport],
                     combine: Any) -> Finished:
        """FedAvg's step on the robust statistic of the round's Δ_i; the sizes and losses kept."""
        fold = self.fold(state, ctx)
        for report in reports:
            fold.add(report)
        return fold.finish(combine([r.delta for r in reports]))


class PowerOfChoiceFold:
    """FedAvg over the clients that replied (the held round's weights: ``ctx.weight``), every
    reply's data size and train loss kept for the next selections."""

    def __init__(self, variant: str, state: PowerOfChoiceState, ctx: RoundContext) -> None:
        self.variant, self.ctx = variant, ctx
        self.state = replace(state, size_of=dict(state.size_of), last_loss=dict(state.last_loss))
        self.reports: list[ClientReport] = []

    def add(self, report: ClientReport) -> None:
        self.reports.append(report)
        self.state.size_of[report.client_id] = report.num_examples
        if report.train_loss is not None:
            self.state.last_loss[report.client_id] = report.train_loss

    def finish(self, robust: np.ndarray | None = None) -> Finished:
        reports, x = self.reports, self.ctx.x
        problems: tuple[str, ...] = ()
        if self.variant == "rpow-d" and reports and all(r.train_loss is None for r in reports):
            problems = (f"rpow-d ranks clients by their last train loss, and no reply carries "
                        f"{names(TRAIN_LOSS)}: add it to the ClientApp's train reply",)
        if not reports:
            return Finished(x, self.state, {}, problems)
        u = robust if robust is not None else weighted_sum([self.ctx.weight(r) for r in reports],
                                                             (r.delta for r in reports))
        return Finished(x + self.ctx.server_lr * u, self.state, {}, problems)


class PowerOfChoice(RuleStrategy):
    """:class:`PowerOfChoiceRule` as a Flower Strategy (Cho et al., AISTATS 2022, Alg. 1)."""

    rule = PowerOfChoiceRule()
