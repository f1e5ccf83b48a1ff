"""A rule is its math: the rule contract, as small values (optax's ``init`` / ``update``, pfl's params).

A rule is an object of a :class:`Rule` subclass; what a rule author reads is this module:

- ``Params``: a frozen dataclass, the rule's own parameters; its fields are the rule's spec keys
  (``fedbuff:k=4`` sets ``k``), checked against their defaults' types. No signature is read.
- ``needs``: a :class:`Needs`, what the rule needs from the adapter (N, per-client rows, the
  oracle's probabilities, the paper's weighting, payloads, its client half, ...).
- ``State``: a dataclass, the rule's state across rounds (what a checkpoint keeps); every field has
  a default, which is the state before :meth:`Rule.init` runs.
- :meth:`Rule.init` ``(ctx) -> state``: the state at the first round (e.g. zeros of the model's size).
- :meth:`Rule.fold` ``(state, ctx) -> Fold``: the round's running aggregate; the adapter adds each
  accepted report (:meth:`Fold.add`, as it arrives, or a held round's reports a block at a time:
  one form of the math for both) and then :meth:`Fold.finish` gives a :class:`Finished`: the new
  model, the new state and the round's metrics.

Everything a rule's hooks need arrives in a :class:`RoundContext` (round, model, N, weights,
node -> client, p^t): a rule reads no attribute of the adapter and never sees a Flower message.
Optional members, with defaults here: :meth:`Rule.train_config` (config that goes out with the
model), :meth:`Rule.evaluated` (the model scored after the round), :meth:`Rule.robust_step` (the
rule's step on a robust statistic of the round's updates, for rules whose update is a mean of
them), :meth:`Rule.validate` (its params against N) and the rule's own reply checks: :meth:`Rule.check` (one reply), :meth:`Rule.check_round`
(the round's replies against the rule's references) and :meth:`Rule.accepted` (the references
after the round), :meth:`Rule.references` (those references, :class:`~strategies.bounds.RatioBound`
values in the state, which the intake begins each round on as it does the norm bounds'),
:meth:`Rule.robust_round` (the round under the robust stage, for a rule whose robust form is not
the statistic of its Δ_i: FedNova's of a_i and Δ_i / a_i), ``needs.metric_hints`` (a missing
metric's own reason), ``needs.server_step`` (the rule's own server step: ``server-lr`` stays 1),
and a selection of the round's nodes: :meth:`Rule.probe` (a probe stage before training, a
:class:`~strategies.intake.Probe` the adapter sends) and :meth:`Rule.select` (the nodes to train,
from the probe's :class:`ProbeAnswers`: a :class:`Selection`), drawing from ``ctx.rng``. A round
that cannot run as the rule needs says why in ``Finished.problems`` (or ``Selection.problems``).
A State field whose value is not saved as it is says how in its metadata
(:func:`strategies.state.kept_as`: FedNova's references, saved as their ``state_dict()``).
The adapter (:mod:`strategies.rule_strategy`)
owns intake, bounds, sampling, evaluation, failures and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from .bounds import MAX_NORM_RATIO, RatioBound
from .intake import Probe
from .payloads import Payload
from .protocol import NUM_EXAMPLES, PLAIN_RULE
from .replies import ClientReport
from .state import NoState


@dataclass(frozen=True)
class Needs:
    """What a rule needs from the adapter (defaults: FedAvg's needs).

    num_clients : the math reads N (``ctx.num_clients``; the adapter finds N when not given).
    client_ids : the rule keeps per-client state in rows 0..N-1 (a reply's client id in [0, N)).
    oracle : the rule reads the schedule's true probabilities p^t (``ctx.probabilities``).
    asynchronous : the rule sees one arrival at a time (:mod:`strategies.asynchronous`).
    paper_weighting : the weighting of the rule's paper, what ``weighting="auto"`` resolves to.
    equal_weights_only : the paper weights every client 1/N: data-size weighting is refused.
    fixed_selection : why the rule cannot address a sampled fraction of the nodes ("" = it can).
    metrics : the reply metrics the rule reads; metric_hints : a missing one's own reason (FedNova's a-norm).
    holds : why the rule must see a whole round at once ("" = it folds replies as they arrive).
    mean_of_updates : the update is a (weighted) mean of the round's Δ_i, which ``robust=median``
        or ``trimmed-mean`` may replace (the rule's :meth:`Rule.robust_step`).
    robust_clip : the checked norm is ‖Δ_i‖, so ``robust=clip`` may scale Δ_i to the bound.
    norm_ratio : the default of ``max-norm-ratio`` for this rule's checked norm.
    client_rule : the rule's client half (``client_app.rules``); ``plain`` trains from the model sent.
    sends, reads : payloads that go out beside the model and that every reply carries back.
    server_step : the spec key that is the rule's own server step (Flower's optimizers' ``eta``):
        the run's ``server-lr`` must then stay 1 ("" = η_g multiplies the rule's update).
    """

    num_clients: bool = False
    client_ids: bool = False
    oracle: bool = False
    asynchronous: bool = False
    paper_weighting: str = "equal"
    equal_weights_only: bool = False
    fixed_selection: str = ""
    metrics: tuple[str, ...] = (NUM_EXAMPLES,)
    metric_hints: Mapping[str, str] = field(default_factory=dict)
    holds: str = ""
    mean_of_updates: bool = False
    robust_clip: bool = True
    norm_ratio: float = MAX_NORM_RATIO
    client_rule: str = PLAIN_RULE
    sends: tuple[Payload, ...] = ()
    reads: tuple[Payload, ...] = ()
    server_step: str = ""


@dataclass(frozen=True)
class RoundContext:
    """What a rule's hooks see of round ``t`` (0-based): the model x^t (flat float32), N, the
    server step η_g, the run's weighting (resolved) and, in a held round, every report's weight
    of the round by client id (``max-weight-share`` caps need the whole round), the node ->
    client binding, and p^t for an oracle."""

    t: int
    x: np.ndarray
    num_clients: int | None = None
    server_lr: float = 1.0
    weighting: str = "equal"
    held_weights: Mapping[int, float] | None = None
    client_of_node: Mapping[int, int] = field(default_factory=dict)
    probabilities: np.ndarray | None = None
    bounded: bool = False  # the ratio bounds are on (max-norm-ratio > 0): rules cap the weights no bound judges
    rng: np.random.Generator | None = None  # the strategy's seeded generator (checkpointed): a rule draws from it

    def weight(self, report: ClientReport) -> float:
        """``report``'s unnormalised weight under the run's weighting: its weight of the held
        round, else n_i (``num-examples``) or 1 (a fold normalises at its end)."""
        if self.held_weights is not None:
            return self.held_weights[report.client_id]
        return float(report.num_examples) if self.weighting == "num-examples" else 1.0

    def require_num_clients(self) -> int:
        if self.num_clients is None:
            raise ValueError("this rule needs num_clients (N)")
        return self.num_clients


class Finished(NamedTuple):
    """A round's result: x^{t+1} (flat, x's dtype), the rule's new state and its metrics; problems:
    why the round could not run as the rule needs (each names a fix: the round counts as failed)."""

    model: np.ndarray
    state: Any
    metrics: dict[str, float]
    problems: tuple[str, ...] = ()


class ProbeAnswers(NamedTuple):
    """A probe stage's answers: node -> the metrics of its valid answer, and the adapter's readers
    of an answer's claims: ``claim(node, metrics)`` binds the node to the client id it reports
    (where the binding allows) and gives the node's client (the node id while none is known);
    ``examples(metrics, known)`` is its num-examples within the run's data-size bounds against
    the ``known`` sizes (None: none, or not a count)."""

    metrics: Mapping[int, Mapping[str, Any]]
    claim: Callable[[int, Mapping[str, Any]], int]
    examples: Callable[[Mapping[str, Any], list[float]], int | None]


class Selection(NamedTuple):
    """The nodes to train this round (among the connected), the rule's state after choosing them,
    the selection's metrics (recorded with the round's) and problems (as :class:`Finished`'s)."""

    nodes: list[int]
    state: Any
    metrics: dict[str, Any]
    problems: tuple[str, ...] = ()


class Fold(Protocol):
    """A round's running aggregate: ``add`` each accepted report (its vectors are not kept),
    then ``finish``."""

    def add(self, report: ClientReport) -> None: ...
    def finish(self) -> Finished: ...


@dataclass(frozen=True)
class NoParams:
    """The parameters of a rule that has none of its own (its spec sets only the shared keys)."""


class Rule:
    """Base of a rule value: the declarations' defaults and the optional members' defaults.

    A subclass declares ``name``, ``Params``, ``needs`` and ``State`` and writes :meth:`fold`
    (and :meth:`init` where its state starts from the model). ``Rule(params)`` or
    ``Rule.of(**spec_values)`` makes one.
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    State: ClassVar[type] = NoState
    needs: Needs = Needs()  # a class's; a rule whose needs follow its params sets its own in __init__ (MIFA)

    def __init__(self, params: Any = None) -> None:
        self.params = self.Params() if params is None else params
        if not isinstance(self.params, self.Params):
            raise TypeError(f"rule {self.name!r}: params must be a {self.Params.__name__}, got {type(params).__name__}")

    @classmethod
    def of(cls, **values: Any) -> Rule:
        """The rule with ``Params(**values)`` (spec keys with ``_`` for ``-``)."""
        return cls(cls.Params(**values))

    @classmethod
    def param_defaults(cls) -> dict[str, Any]:
        """The spec keys (``Params``' fields, ``-`` for ``_``) and their defaults (None: required)."""
        return {f.name.replace("_", "-"): None if f.default is MISSING else f.default for f in fields(cls.Params)}

    def with_params(self, **changes: Any) -> Rule:
        return type(self)(replace(self.params, **changes))

    def validate(self, num_clients: int | None) -> None:
        """Check the params against N when the adapter is built (ClusterFedVARP: C ≤ N); raise
        ValueError naming the problem."""

    # ---------------------------------------------------------------- the math
    def init(self, ctx: RoundContext) -> Any:
        """The state at the first round (default: ``State()``)."""
        return self.State()

    def fold(self, state: Any, ctx: RoundContext) -> Fold:
        raise NotImplementedError

    # ------------------------------------------------------ optional members (defaults)
    def train_config(self, state: Any, ctx: RoundContext) -> dict[str, Any]:
        """Extra config sent with round ``ctx.t``'s train messages."""
        return {}

    def evaluated(self, state: Any, model: np.ndarray, ctx: RoundContext) -> np.ndarray | None:
        """The model to score after round ``ctx.t`` gave ``model`` (None, the default: ``model``
        itself; FedExP scores the average of the last two iterates)."""
        return None

    def check(self, state: Any, report: ClientReport) -> None:
        """Rule-specific checks of one parsed reply, its payloads decoded: raise
        :class:`~strategies.replies.ReplyRejected` with the reason to reject it (MIFA: its lr
        against the recently accepted ones). Runs before the round's bounds."""

    def check_round(self, state: Any, reports: list[ClientReport],
                    reject: Callable[[int, str], None]) -> list[ClientReport]:
        """The reports within the rule's own count bounds (FedNova's steps), before the norm
        bounds; ``reject(node_id, reason)`` for each of the others."""
        return reports

    def accepted(self, state: Any, reports: list[ClientReport]) -> Any:
        """The state after the round's accepted ``reports`` (what the rule's checks compare the
        next replies with); the adapter calls it on the state :meth:`Fold.finish` gave."""
        return state

    def probe(self, state: Any, ctx: RoundContext, connected: list[int]) -> Probe | None:
        """The round's probe stage before training (power-of-choice's candidates; None, the
        default: none): the adapter sends it and hands the answers to :meth:`select`."""
        return None

    def select(self, state: Any, ctx: RoundContext, connected: list[int], probe: Probe | None,
               answers: ProbeAnswers) -> Selection:
        """The connected nodes to train this round (default: every one the sampler gave)."""
        return Selection(connected, state, {})

    def references(self, state: Any) -> Sequence[RatioBound]:
        """The reference bounds :meth:`check_round` reads in ``state`` (FedNova's τ and ‖a‖_1): the
        intake begins each round on them (its first judgement fixes each reference) and judges a
        reply at once only when they are settled, as it does the norm bounds."""
        return ()

    def robust_round(self, state: Any, ctx: RoundContext, reports: list[ClientReport],
                     combine: Callable[[list[np.ndarray]], np.ndarray]) -> Finished:
        """The round's result under ``robust=median`` / ``trimmed-mean``: ``combine(vectors)`` is the
        coordinate-wise statistic of equal-shaped float32 vectors. Default: :meth:`robust_step` on
        the statistic of the Δ_i (FedNova takes it of a_i and of Δ_i / a_i)."""
        return self.robust_step(state, ctx, combine([r.delta for r in reports]), len(reports))

    def robust_step(self, state: Any, ctx: RoundContext, statistic: np.ndarray, count: int) -> Finished:
        """The round's result when a robust statistic of the ``count`` accepted Δ_i (float32)
        replaces the rule's mean (rules that declare ``needs.mean_of_updates``)."""
        raise NotImplementedError(f"rule {self.name!r} declares no mean of updates a robust statistic may replace")

