"""The Flower ``Strategy`` around a rule value (:mod:`strategies.contract`).

:class:`RuleStrategy` is the adapter (:class:`strategies.base.AvailabilityStrategy`: intake,
bounds, sampling, evaluation, failures, checkpoints) with one rule value in it: it builds each
round's :class:`~strategies.contract.RoundContext`, keeps the rule's state between rounds (in,
out: never the rule's attributes), feeds the fold the round's accepted reports (as they arrive,
or a held round's a block at a time) and takes the new model, state and metrics from
:meth:`~strategies.contract.Fold.finish`. The robust stage (``robust=median`` / ``trimmed-mean``)
computes its statistic before the rule and hands it to the rule's ``robust_step``.

Each registered rule is a Flower Strategy class a Flower user instantiates with Flower's
arguments and the rule's own (``FedAvgActive(fraction_evaluate=0.5)``), one line of class body
(``rule = FedAvgActiveRule()``); the declarations the adapter reads of the class (``name``,
``paper_weighting``, ``State``, ...) are read from the rule (:class:`FromRule`), so nothing is
written twice. A user's own rule value runs as ``RuleStrategy(rule=MyRule(), num_clients=10)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Generic, TypeVar

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from . import rule as legacy
from .base import AvailabilityStrategy
from .contract import Finished, Fold as RuleFold, Needs, ProbeAnswers, RoundContext, Rule, Selection
from .intake import Probe
from .protocol import CLIENT_ID, NUM_EXAMPLES
from .replies import ClientReport, ReplyRejected, count
from .state import capture, loaded
from .streaming import Fold, held_round

T = TypeVar("T")
DEFAULT = Needs()


class FromRule(Generic[T]):
    """A declaration of the adapter read from its rule (the instance's, else the class's ``rule``),
    or ``default`` for a class without one; a class body that assigns the name overrides it."""

    def __init__(self, read: Callable[[Rule], T], default: T) -> None:
        self.read, self.default = read, default

    def __get__(self, obj: Any, owner: type) -> T:
        rule = getattr(owner if obj is None else obj, "rule", None)
        return self.default if rule is None else self.read(rule)


def _needs(read: Callable[[Needs], T], default: T) -> FromRule[T]:
    return FromRule(lambda rule: read(rule.needs), default)


class RuleStrategy(AvailabilityStrategy):
    """The adapter with one rule value (the module docstring).

    ``rule``: the rule value (default: the class's); ``probabilities``: p^t by round, for a rule
    that declares ``needs.oracle``; the rule's own parameters (``Params``' fields) and the shared
    ones (:class:`strategies.params.StrategyParams`, Flower's ``FedAvg`` arguments among them) as
    keyword arguments.
    """

    rule: Rule  # the class's rule value (each registered rule's class sets it; an instance may hold its own)

    # the declarations the adapter reads, from the rule (defaults: a class without one)
    name = FromRule(lambda r: r.name, "")
    State = FromRule(lambda r: r.State, legacy.Rule.State)
    required_metrics = _needs(lambda n: n.metrics, DEFAULT.metrics)
    metric_hints = _needs(lambda n: dict(n.metric_hints), legacy.Rule.metric_hints)
    needs_client_ids = _needs(lambda n: n.client_ids, DEFAULT.client_ids)
    needs_num_clients = _needs(lambda n: n.num_clients, DEFAULT.num_clients)
    fixed_selection = _needs(lambda n: n.fixed_selection, DEFAULT.fixed_selection)
    equal_weights_only = _needs(lambda n: n.equal_weights_only, DEFAULT.equal_weights_only)
    paper_weighting = _needs(lambda n: n.paper_weighting, DEFAULT.paper_weighting)
    default_norm_ratio = _needs(lambda n: n.norm_ratio, DEFAULT.norm_ratio)
    mean_of_updates = _needs(lambda n: n.mean_of_updates, DEFAULT.mean_of_updates)
    robust_clip = _needs(lambda n: n.robust_clip, DEFAULT.robust_clip)
    asynchronous = _needs(lambda n: n.asynchronous, DEFAULT.asynchronous)
    streams = _needs(lambda n: not n.holds, False)
    holds_replies = _needs(lambda n: n.holds, legacy.Rule.holds_replies)
    client_rule = _needs(lambda n: n.client_rule, DEFAULT.client_rule)
    sends = _needs(lambda n: n.sends, DEFAULT.sends)
    reads = _needs(lambda n: n.reads, DEFAULT.reads)

    def __init__(self, params: Any = None, *, rule: Rule | None = None,
                 probabilities: Callable[[int], np.ndarray] | None = None, **kwargs: Any) -> None:
        value = rule if rule is not None else getattr(type(self), "rule", None)
        if value is None:
            raise TypeError(f"{type(self).__name__}: no rule (pass rule=..., a strategies.contract.Rule)")
        own = {f.name for f in fields(value.Params)}
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        self.rule = value.with_params(**mine) if mine else value
        if self.rule.needs.oracle and probabilities is None:
            raise ValueError(f"strategy '{self.rule.name}' is an oracle: it needs probabilities=p (p(t) -> p^t)")
        self.probabilities = probabilities
        super().__init__(params, **kwargs)
        self.rule.validate(self.num_clients)
        if (key := self.rule.needs.server_step) and self.server_lr != 1.0:
            raise ValueError(f"strategy '{self.name}': its server step is the optimizer's learning rate: set "
                             f"'{self.name}:{key}=...' and leave run config 'server-lr' at 1 (got {self.server_lr})")
        self.rule_state: Any = None  # the rule's state, from its init at the first round
        self._before: Any = None  # State() before the init: one value, which the first round's checks read

    # ------------------------------------------------------------------ the round's context
    def context(self, t: int, x: np.ndarray, held_weights: dict[int, float] | None = None) -> RoundContext:
        """Round t's :class:`RoundContext` (x: x^t, flat); an oracle's p^t asked once per round."""
        if self.probabilities is not None and self._p[0] != t:
            self._p = (t, np.asarray(self.probabilities(t), np.float64))
        return RoundContext(t, x, self.num_clients, self.server_lr, self.weighting, held_weights,
                            self.binding.client_of_node, self._p[1], bool(self.bounds.max_norm_ratio), self.rng)

    _p: tuple[int | None, np.ndarray | None] = (None, None)  # (round, p^t) of the last context

    def _state(self, ctx: RoundContext) -> Any:
        if self.rule_state is None:
            self.rule_state = self.rule.init(ctx)
        return self.rule_state

    def _finish(self, done: Finished, ctx: RoundContext) -> tuple[np.ndarray, dict[str, float]]:
        """Take a finished round: the rule's new state kept (after :meth:`Rule.accepted` of the
        round's accepted reports), its context for :meth:`evaluation_arrays`."""
        state, self.folded = done.state, ctx
        self.round.problems += done.problems
        if self._accepted is not None:
            state, self._accepted = self.rule.accepted(state, self._accepted), None
        self.rule_state = state
        return done.model, {**(self.selection.metrics if self.selection is not None else {}), **done.metrics}

    selection: Selection | None = None  # the last round's selection (:meth:`select_nodes`)

    # ------------------------------------------------------------- the round's selection
    def probe_request(self, server_round: int, connected: list[int]) -> Probe | None:
        """The rule's probe stage (:meth:`Rule.probe`), sent by the base before :meth:`select_nodes`."""
        ctx = self.context(server_round - 1, self.current if self.current is not None else np.zeros(0, np.float32))
        return self.rule.probe(self._state(ctx), ctx, connected)

    def select_nodes(self, server_round: int, arrays: ArrayRecord, connected: list[int], grid: Grid) -> list[int]:
        """The rule's choice (:meth:`Rule.select`) among the connected nodes, from the probe's answers;
        its state kept, its problems the round's, its metrics recorded with the round's."""
        ctx = self.context(server_round - 1, self.current if self.current is not None else np.zeros(0, np.float32))
        chosen = self.rule.select(self._state(ctx), ctx, connected, self.round.probe,
                                  self.probe_answers(self.round.probe_answers))
        self.rule_state, self.selection = chosen.state, chosen
        self.round.problems += chosen.problems
        return chosen.nodes

    def probe_answers(self, answers: dict[int, dict[str, Any]]) -> ProbeAnswers:
        """The probe's answers with the readers of their claims (:class:`ProbeAnswers`)."""
        return ProbeAnswers(answers, self._claim, self._examples)

    def _claim(self, node: int, metrics: Mapping[str, Any]) -> int:
        with contextlib.suppress(ReplyRejected):
            client = count(metrics, CLIENT_ID, 0, (self.num_clients or 2**63) - 1, default=None)
            if client is not None and self.binding.may_claim(node, client):  # never another node's client
                self.client_of_node[node] = client
        return self.binding.client(node, node)

    def _examples(self, metrics: Mapping[str, Any], known: list[float]) -> int | None:
        try:  # a claim: at most the data-size bound, as a training reply's
            size = count(metrics, NUM_EXAMPLES, 1, self.max_num_examples, default=None)
        except ReplyRejected:
            return None
        return None if size is None else int(min(size, self.bounds.examples.limit(known)))

    _accepted: list[ClientReport] | None = None  # the round's accepted reports, until its finish

    # ------------------------------------------------------------ the rule's own checks
    def check_report(self, report: ClientReport) -> None:
        self.rule.check(self.kept_state(), report)

    def check_counts(self, rnd: Any, reports: list[ClientReport]) -> list[ClientReport]:
        return self.rule.check_round(self.kept_state(), reports, rnd.reject)

    def commit_counts(self, accepted: list[ClientReport]) -> None:
        """The round's accepted reports: the intake ends before the fold finishes, so the rule's
        :meth:`Rule.accepted` runs on the state the fold's finish gives (:meth:`_finish`)."""
        self._accepted = list(accepted)

    # -------------------------------------------------------- the legacy hooks, on the rule
    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        """A streamed round: the rule's fold, its finish taken by the adapter."""
        ctx = self.context(t, x)
        return _Taken(self, self.rule.fold(self._state(ctx), ctx), ctx)

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, float]]:
        """A held round: the robust stage (its statistic to the rule's ``robust_step``), else the
        same fold, every report's weight of the round known, fed a block at a time."""
        held = dict(zip((r.client_id for r in reports), map(float, self.weights(reports)), strict=True)) \
            if reports else None
        ctx = self.context(t, x, held)
        state = self._state(ctx)
        if self.robust.combines and reports:
            return self._finish(self.rule.robust_round(state, ctx, reports, self._combine), ctx)
        fold = self.rule.fold(state, ctx)
        with held_round():
            for report in reports:
                fold.add(report)
        return self._finish(fold.finish(), ctx)

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        """The rule's config for round t (asked before the round's model is set, too: its state
        then is the one before its init)."""
        ctx = self.context(t, self.current if self.current is not None else np.zeros(0, np.float32))
        return self.rule.train_config(self.kept_state(), ctx)

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model the rule scores after its last round (:meth:`strategies.contract.Rule.evaluated`)."""
        if self.folded is None or self.layout is None or self.layout.mismatch(arrays) is not None:
            return arrays
        scored = self.rule.evaluated(self.rule_state, self.layout.flatten(arrays), self.folded)
        return arrays if scored is None else self.arrays_of(scored)

    folded: RoundContext | None = None  # the context of the last round folded

    def _combine(self, vectors: list[np.ndarray]) -> np.ndarray:
        """The robust statistic of ``vectors`` (stacked into a matrix kept per row shape)."""
        name = "robust" if np.size(vectors[0]) > 1 else "robust-scalar"
        return self.robust.combine(self.stacked(name, vectors))

    def state_references(self) -> list[Any]:
        """The reference bounds in the rule's state (:meth:`Rule.references`), for the intake."""
        return list(self.rule.references(self.kept_state()))

    # ------------------------------------------------------------------------ state
    def kept_state(self) -> Any:
        """The rule's state now (one ``State()`` before its first round)."""
        if self.rule_state is not None:
            return self.rule_state
        if self._before is None:
            self._before = self.rule.State()
        return self._before

    def get_state(self) -> Any:
        """A copy of the rule's state (its fields saved as their :func:`~strategies.state.kept_as` say)."""
        if self.State is not self.rule.State:  # a subclass that declares a State of its own (legacy)
            return super().get_state()
        return capture(self.kept_state(), self.rule.State)

    def set_state(self, state: Any) -> None:
        if self.State is not self.rule.State:
            super().set_state(state)
            return
        self.rule_state = loaded(state, self.rule)


class _Taken(Fold):
    """The rule's fold as the adapter's streaming fold: its finish's state kept by the adapter."""

    def __init__(self, owner: RuleStrategy, fold: RuleFold, ctx: RoundContext) -> None:
        self.owner, self.fold, self.ctx = owner, fold, ctx

    def add(self, report: ClientReport) -> None:
        self.fold.add(report)

    @property
    def sum(self) -> Any:
        """The rule fold's running sum (the secure round adds SecAgg+'s unmasked sum to it)."""
        return self.fold.sum  # type: ignore[attr-defined]

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        return self.owner._finish(self.fold.finish(), self.ctx)
