"""Spec option ``secure=secagg+``: a rule whose server step is a weighted sum of the round's updates,
run on Flower's SecAgg+, so the server sees only the sum (issue 35, item 4).

**Which rules.** x^{t+1} = x^t + η_g · c · Σ_{i∈A_t} w_i Δ_i, with w_i known before the client
trains and c known once the round's participants A_t are: FedAvg over the active (w_i = 1 or n_i,
c = 1/Σ w_i), over all (1, 1/N), with known p (1/p_i^t, 1/N), FedAU (ω_i, 1/N; Wang & Ji, ICML
2024, Alg. 1 line 11), debiased FedAvg (1/c_i, C/(N|A_t|); Sun et al., ICLR 2025, Sec. 5). Their
folds (:mod:`strategies.streaming`) already add w_i Δ_i reply by reply; under ``secure`` each
client multiplies its own Δ_i by its weight before masking (``secure-factors``, one per client id,
divided by the largest so that no factor exceeds 1), SecAgg+ (:mod:`strategies.secagg`) gives the
sum of the survivors' vectors, and the rule's own fold finishes the round: it is fed the survivors'
replies with their metrics in the clear and Δ_i = 0 (its bookkeeping, weights' sum and state
updates run unchanged: FedAU's intervals, debiased FedAvg's counts), and the unmasked sum, times
the largest weight, is added to its running sum (:meth:`RunningSum.add_sum`). Every other rule
refuses with the reason (:data:`REFUSALS`): a config error before any training.

**Bounds.** The norm bounds read each ‖Δ_i‖, which the server no longer sees: ``max-update-norm``
moves to the client, which clips ‖Δ_i‖₂ to it before masking (``secure-clip-norm``); the ratio
bounds (``max-norm-ratio``, ``max-model-ratio``, ``max-examples-ratio``), ``max-weight-share`` and
``robust`` need each update or each weight against the round's and are refused when set. The
reply checks that need no update (client ids, counts, metrics) still run on the survivors'
metrics; a survivor whose reply they reject makes the round apply nothing (its vector is in the
sum: fail closed). A round SecAgg+ halts (fewer than its threshold of active clients) applies no
update and is recorded as such (``secure-completed`` = 0, the reason logged). A round a client
attacks fails closed (issue 47, item 4): a malformed stage reply (its node named and dropped), a
stage that raises, an unmasked sum whose weight element or integer range no honest survivors give
(:mod:`strategies.secagg_checks`), or a sum whose norm exceeds the survivors' factors × the
client-side clip (:meth:`_SecureFold.norm_problem`) applies nothing and is a failed round with the
reason in its problems (``secure-attack`` = 1), never churn and never an exception. Too few clients
online, clients that left mid-round, or error replies (which the plain rules also count as
unavailable) make an empty round, as a round with nobody online: churn is not a failure, and
nodes that stay away cannot end the run (``max_failed_rounds`` counts none of it). A run in which
no round completes says so at its end, as any run without work.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp import Grid

from .base import AvailabilityStrategy, ClientReport
from .protocol import (
    NUM_EXAMPLES,
    SECURE_CLIP_NORM,
    SECURE_CLIPPING_RANGE,
    SECURE_EXAMPLE_SCALE,
    SECURE_FACTORS,
)
from .rule import Rule
from .secagg import SecAggOutcome, SecAggPlusSettings, secagg_plus_round
from .streaming import Fold

log = logging.getLogger("flwr")

KINDS = ("secagg+",)
# the rules whose server step is a weighted sum of the round's updates, weights known before masking
SECURE_RULES = frozenset({"fedavg-active", "fedavg-all", "fedavg-known-p", "fedau", "debiased-fedavg"})
EXAMPLE_SCALE = 1000.0  # data-size weights: n_i / this until a round's replies show the largest n_i
_STATE = "its per-client state is read and written with each client's own update"
REFUSALS = {
    "mifa": "its update averages a table of each client's latest Δ_i (N × d rows), which needs each update",
    "fedvarp": "it keeps each client's latest update (its variance-reduction table), which needs each update",
    "cluster-fedvarp": "it keeps each cluster's latest updates, which needs each update",
    "stale": "it keeps each client's latest update to reuse in the rounds it misses, which needs each update",
    "fedstale": "it keeps each client's latest update to reuse in the rounds it misses, which needs each update",
    "fl-fdms": "it stores each client's update and compares clients' updates (similarities), which needs each update",
    "full": ("an oracle that trains every client despite the schedule (ignore-availability), which SecAgg+'s "
             "other stages, dated like any round message, would not reach (not built)"),
    "fedawe": "its clients echo their own models weighted per client (t − τ_i), and its bounds read each echo",
    "fedpbc": "its clients echo their own kept models, and its bounds read each echo",
    "fedexp": "its server step size reads each update's norm ‖Δ_i‖² against the norm of their mean",
    "fedaware": "it re-weights the round by the updates' norms and pairwise geometry (a Gram matrix)",
    "fednova": "its weights read each client's ‖a_i‖₁ and its step-count bound reads each reply's steps "
               "(a client-side division would fit SecAgg+; not built)",
    "scaffold": f"its control variates' bounds read each Δc_i and {_STATE}",
    "amplified-scaffold": f"its control variates' bounds read each Δc_i and {_STATE}",
    "pow-d": "it chooses clients by their probed losses each round; its aggregate is not declared secure (not built)",
    "fedadam": "Flower's server optimiser over the mean update would fit SecAgg+; not built",
    "fedyogi": "Flower's server optimiser over the mean update would fit SecAgg+; not built",
    "fedadagrad": "Flower's server optimiser over the mean update would fit SecAgg+; not built",
    "fedavgm": "Flower's server optimiser over the mean update would fit SecAgg+; not built",
}
ASYNCHRONOUS = ("it is asynchronous: SecAgg+ masks a round of clients together, and its buffer folds one "
                "arrival at a time (a buffer of K arrivals as one SecAgg+ group is not built)")
GENERIC = ("its server step is not declared a weighted sum of the round's updates with weights known "
           "before masking (strategies/secure.py lists the rules that are)")


def refusal(cls: type[AvailabilityStrategy]) -> str:
    """Why rule class ``cls`` cannot run with ``secure`` ("" when it can)."""
    if getattr(cls, "asynchronous", False):
        return ASYNCHRONOUS
    if cls.name in REFUSALS:
        return REFUSALS[cls.name]
    owner = next((c for c in cls.__mro__ if _declared_name(c) in SECURE_RULES
                  and c.__module__.startswith("strategies.rules")), None)  # the built-in rule (a user's subclass's parent)
    if owner is None:
        return GENERIC
    for klass in cls.__mro__[:cls.__mro__.index(owner)]:
        mine = [h for h in ("aggregate", "start_fold", "train_arrays", "send_payloads") if h in vars(klass)]
        if mine and not issubclass(klass, SecureRound):
            return (f"{klass.__name__} overrides {', '.join(mine)} of {owner.__name__}: the secure round "
                    f"applies {owner.__name__}'s own weighted sum")
    return ""


def _declared_name(klass: type) -> str | None:
    """The rule name ``klass``'s own body declares: its ``name``, or its rule value's."""
    rule = vars(klass).get("rule")
    return vars(klass).get("name") or (rule.name if rule is not None else None)


def secure_kind(value: Any) -> str:
    """The ``secure`` spec value: "" (off) or one of :data:`KINDS`; ValueError otherwise."""
    text = str(value or "").strip().lower()
    if text in ("", "off", "none", "false"):
        return ""
    if text not in KINDS:
        raise ValueError(f"secure (spec key secure) must be one of {list(KINDS)} or '' (off), got {value!r}")
    return text


def secure_spec(spec: str) -> bool:
    """Whether a strategy spec sets ``secure`` on (``fedau:secure=secagg+``), read from its text."""
    for part in spec.replace(":", ",").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "secure":
            try:
                return bool(secure_kind(value))
            except ValueError:
                return True  # the strategy's own check names the bad value
    return False


def secure_class(cls: type[AvailabilityStrategy], value: Any) -> type[AvailabilityStrategy]:
    """``cls`` itself when ``secure`` is off, else its secure variant; ValueError naming the reason
    when the rule cannot run on SecAgg+."""
    if not secure_kind(value):
        return cls
    why = refusal(cls)
    if why:
        raise ValueError(f"strategy '{cls.name}' cannot run with secure={value} (SecAgg+ gives the server only "
                         f"the sum of the round's weighted updates): {why}")
    return _secure_variant(cls)


@functools.cache
def _secure_variant(cls: type[AvailabilityStrategy]) -> type[AvailabilityStrategy]:
    return type(cls.__name__ + "SecAggPlus", (SecureRound, cls), {"__module__": __name__, "__doc__": (
        f"{cls.__name__} on SecAgg+ (spec option secure=secagg+): :class:`SecureRound`.")})


class SecureRound(AvailabilityStrategy):
    """The secure round (mixed in before a rule of :data:`SECURE_RULES`; built by :func:`secure_class`).

    ``configure_train`` runs the whole SecAgg+ round on the grid it is given (Flower's stages,
    :func:`strategies.secagg.secagg_plus_round`) and returns no message; ``aggregate_train`` then
    applies the rule to the survivors (their metrics, Δ_i = 0, and the unmasked sum). So the
    ServerApp's loop, Flower's ``Strategy.start`` and a user's loop run it unchanged.

    Spec keys: ``secure`` (``secagg+``), ``secure-shares``, ``secure-threshold``,
    ``secure-clipping-range``, ``secure-timeout`` (:class:`SecAggPlusSettings`).
    """

    def __init__(self, *, secure: str = "secagg+", secure_shares: float = 1.0, secure_threshold: float = 0.6,
                 secure_clipping_range: float = 8.0, secure_timeout: float = 120.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.secure = secure_kind(secure) or KINDS[0]
        self.settings = SecAggPlusSettings(_count_or_fraction(secure_shares), _count_or_fraction(secure_threshold),
                                           float(secure_clipping_range), timeout=float(secure_timeout))
        p = self.params
        refused = {"robust": p.robust and str(self.robust) != "off", "max-norm-ratio": p.max_norm_ratio,
                   "max-model-ratio": p.max_model_ratio, "max-examples-ratio": p.max_examples_ratio,
                   "max-weight-share": p.max_weight_share}
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(f"strategy '{self.name}' with secure={self.secure}: {', '.join(bad)} need(s) each update "
                             f"or each weight against the round's, which SecAgg+ hides; leave them unset (the "
                             f"client clips ‖Δ_i‖ to max-update-norm before masking)")
        self.bounds = self.bounds.__class__(self.bounds.max_update_norm, 0.0, 0.0, 0.0)  # the ratio bounds: off
        self.example_scale = EXAMPLE_SCALE  # data-size weights: the largest n_i seen so far
        self.secure_scale = 1.0  # this round's largest weight (the factors sent are weights / it)
        self.by_examples = False  # the rule weights by num-examples: the client also scales by n_i / example_scale
        self.outcome: SecAggOutcome | None = None
        self.secure_sent: list[Message] = []  # this round's train messages (their contents went out in stage 2)
        self.secure_factors = np.zeros(0)  # this round's factors sent, per client id
        self.secure_attack = False

    # --------------------------------------------------------------- the weights sent
    def client_weights(self, t: int) -> np.ndarray:
        """w_c for every client id c: the weight the rule's own fold gives client c's Δ in round t
        (per example under data-size weights: ``by_examples``), read by folding a zero update of
        each client into a fold of its own."""
        n = self.require_num_clients()
        fold = super().start_fold(t, np.zeros(1, np.float32))

        def weight(client: int, examples: int) -> float:
            fold.sum.weight = 0.0  # type: ignore[attr-defined]  # every fold of SECURE_RULES keeps a RunningSum
            fold.add(ClientReport(client_id=client, node_id=-1, delta=np.zeros(1, np.float32), num_examples=examples))
            return float(fold.sum.weight)  # type: ignore[attr-defined]

        weights = np.array([weight(c, 1) for c in range(n)], np.float64)
        self.by_examples = bool(n) and weight(0, 2) == 2 * weights[0] != 0
        return weights

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        weights = self.client_weights(t)
        self.secure_scale = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
        self.secure_factors = weights / self.secure_scale
        return {**super().train_config(t, node_ids),
                SECURE_FACTORS: [float(w) for w in self.secure_factors],
                SECURE_EXAMPLE_SCALE: self.example_scale if self.by_examples else 0.0,
                SECURE_CLIP_NORM: float(self.bounds.max_update_norm),
                SECURE_CLIPPING_RANGE: float(self.settings.clipping_range)}

    # ------------------------------------------------------------------- the round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        sent = list(super().configure_train(server_round, arrays, config, grid))
        contents = {m.metadata.dst_node_id: m.content for m in sent}
        self.outcome = secagg_plus_round(grid, server_round, contents, self.settings, seed=self.params.seed) \
            if len(contents) >= 1 else SecAggOutcome()
        self.secure_sent = sent
        return []  # the round ran: nothing more to send

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[ArrayRecord | None, MetricRecord | None]:
        for stray in replies:
            log.warning("%s (secure): a reply outside SecAgg+'s stages is ignored (node %s)", self.name,
                        stray.metadata.src_node_id)
        out, rnd = self.outcome or SecAggOutcome(), self.round
        self.secure_attack = False  # the sum's norm beyond what the survivors' clip allows (_SecureFold)
        assert self.current is not None and self.layout is not None
        synthetic: list[Message] = []
        if out.completed:
            record = self.arrays_of(self.current)  # Δ_i = 0: the rule's fold counts the weight, the sum comes unmasked
            sent = [out.sent.get(m.metadata.dst_node_id, m) for m in self.secure_sent]
            problems = rnd.problems
            self.round = rnd = self.intake.new_round(sent, rnd.connected, self.current, self.layout)
            rnd.problems += problems
            for node, reply in sorted(out.survivors.items()):
                metrics = _plain_metrics(reply)
                synthetic.append(Message(RecordDict({"arrays": record, "metrics": MetricRecord(metrics)}),
                                         reply_to=out.sent[node]))
        elif out.attacks:  # a malformed reply, a stage that raised, a sum no honest survivors give: failed closed
            rnd.problems += out.attacks  # (logged by secagg_plus_round)
        elif out.problems:  # not churn: the ClientApps cannot do SecAgg+ (a failed round, the reason named)
            log.error("%s (secure), round %d: %s", self.name, server_round, out.problems[0])
            rnd.problems += out.problems
        elif out.addressed:  # halted: too few were there (offline, left, or answered errors): an empty round
            log.warning("%s (secure), round %d: %s: an empty round (churn), not a failed one", self.name,
                        server_round, out.failures[-1])
        for why in out.failures[:-1] if not (out.completed or out.attacks or out.problems) else out.failures:
            log.warning("%s (secure), round %d: %s", self.name, server_round, why)
        new, aggregated = super().aggregate_train(server_round, synthetic)
        record_metrics: dict[str, Any] = dict(aggregated or {})
        record_metrics.update({"secure-completed": int(out.completed), "secure-survivors": len(out.survivors),
                               "secure-threshold": out.threshold, "secure-addressed": len(out.addressed)})
        if out.attacks or self.secure_attack:  # failed closed: recorded as an attack (the reason: the problems)
            record_metrics["secure-attack"] = 1
        if out.dropped:  # malformed before training: those nodes dropped, the round run again (logged)
            record_metrics["secure-dropped"] = len(out.dropped)
        return new, MetricRecord(record_metrics)

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        return _SecureFold(super().start_fold(t, x), self, x)

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, float]]:
        return Rule.aggregate(self, t, x, reports)  # the fold, whatever the rule's own aggregate does


def _count_or_fraction(value: float) -> float:
    """A spec's ``secure-shares`` / ``secure-threshold``: a whole number above 1 is a count (Flower's int),
    anything else a fraction (Flower's float)."""
    v = float(value)
    return int(v) if v.is_integer() and v > 1 else v


def _plain_metrics(reply: Message) -> dict[str, Any]:
    """The metrics a survivor's stage-2 reply carries in the clear (Flower's ``fitres.metrics``)."""
    return dict(compat.recorddict_to_fitres(reply.content, keep_input=True).metrics)


class _SecureFold(Fold):
    """The rule's fold fed zero updates of the survivors, plus SecAgg+'s sum at the end."""

    def __init__(self, fold: Fold, rule: SecureRound, x: np.ndarray) -> None:
        self.fold, self.rule, self.x = fold, rule, x
        self.nodes: set[int] = set()
        self.examples: list[int] = []
        self.clients: list[int] = []

    def add(self, report: ClientReport) -> None:
        self.fold.add(report)
        self.nodes.add(report.node_id)
        self.examples.append(report.num_examples)
        self.clients.append(report.client_id)

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        out = self.rule.outcome
        if out is None or not out.completed or out.total is None:
            return self.fold.finish()  # a halted round is an empty round (FedAU still counts the absences)
        if self.nodes != set(out.survivors):
            self.rule.round.problems.append(
                f"SecAgg+'s sum holds the vectors of nodes {sorted(set(out.survivors) - self.nodes)} whose replies "
                f"were rejected: the round applies nothing (fail closed)")
            return self.x, {}
        if why := self.norm_problem(out.total):
            self.rule.round.problems.append(why)
            self.rule.secure_attack = True
            log.warning("%s (secure): %s", self.rule.name, why)
            return self.x, {}
        scale = self.rule.secure_scale
        if self.rule.by_examples:  # the clients scaled by n_i / example_scale; the next round's scale: the largest n_i
            scale *= self.rule.example_scale
            self.rule.example_scale = float(max(self.examples, default=self.rule.example_scale))
        self.fold.sum.add_sum(scale * out.total)  # type: ignore[attr-defined]
        return self.fold.finish()

    def norm_problem(self, total: np.ndarray) -> str:
        """Why ‖Σ f_i clip(Δ_i)‖ is beyond what the survivors can give ("" when it is not): each
        honest survivor adds at most its factor × the client-side clip, plus one quantum per entry."""
        rule, clip = self.rule, float(self.rule.bounds.max_update_norm)
        if not clip > 0 or not math.isfinite(clip):
            return ""
        factors = rule.secure_factors
        own = [float(factors[c]) if 0 <= c < len(factors) else 1.0 for c in self.clients]
        if rule.by_examples:
            own = [f * n / rule.example_scale for f, n in zip(own, self.examples, strict=True)]
        slack = len(own) * rule.settings.quantum * math.sqrt(max(total.size, 1))
        bound, norm = clip * sum(own) + slack, float(np.linalg.norm(total))
        if norm <= bound:
            return ""
        return (f"SecAgg+ attack: the unmasked sum's norm {norm:.4g} exceeds what its {len(own)} survivor(s) can "
                f"give, {bound:.4g} (their factors × the client-side clip max-update-norm={clip:g}, plus "
                f"quantisation): a survivor (not attributable: the sum is masked) sent more; the round fails "
                f"closed (no update applied)")


__all__ = ["KINDS", "NUM_EXAMPLES", "REFUSALS", "SECURE_RULES", "SecureRound", "refusal", "secure_class", "secure_kind"]
