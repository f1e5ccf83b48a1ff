"""Evaluation, a part the strategy holds (``strategy.evaluation``): Flower's evaluate round,
the round-end broadcast, and what ``evaluate_fn`` is shown.

Flower's ``Strategy.start`` calls ``evaluate_fn(round, arrays)`` on the global model. Some rules
are scored on another model: FedExP on the mean of its last two iterates (``evaluation_arrays``),
and FedAWE's official code on x̄, the mean of every client's copy (``extra_evaluation_arrays``:
``{"xbar": x̄}``). :func:`scored_evaluate_fn` wraps an ``evaluate_fn`` so that it sees the scored
model, and adds each extra model's metrics under ``<metric>-<name>`` (``accuracy-xbar``), as the
project's ServerApp records ``test-accuracy-xbar``. ``AvailabilityStrategy.start`` applies it.

:class:`Evaluation` is the base's Flower evaluate round: the round-end broadcast (FedAWE's,
which Flower's ``start`` thus delivers right after aggregation), then the scored model to a
``fraction_evaluate`` sample, and the clients' metrics aggregated. The strategy keeps Flower's
method names (``configure_evaluate``, ``aggregate_evaluate``) and hands them to this part.

A user's subclass with its own ``start`` loop (``class Mine(FedExP)``, Flower's advanced-pytorch)
is adopted once, when the strategy is built (:meth:`Evaluation.adopt_loop`): that instance's
``start`` gets its ``evaluate_fn`` wrapped by :func:`scoring_start`. A loop that calls
``evaluate_fn`` some other way must pass it through ``scored_evaluate_fn(strategy, evaluate_fn)``,
else the rule says at WARNING, once, that its ``evaluate_fn`` sees x^{t+1} and not the rule's
scored model.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid

from .failures import check_broadcast
from .intake import Probe
from .metrics import canonical, weighted_mean
from .options import RecordKeys
from .protocol import ADOPT, CLIENT_RULE, PLAIN_RULE, SERVER_ROUND
from .replies import destinations, source_node
from .sampling import Sampling

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
SCORED = "_flchurn_scored"  # marks an evaluate_fn or a start already wrapped here
flwr_log = logging.getLogger("flwr")
def scored_evaluate_fn(strategy: Any, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:
    """``evaluate_fn`` run on ``strategy.evaluation_arrays(arrays)`` and on each of
    ``strategy.extra_evaluation_arrays(arrays)`` (None stays None; a wrapped one is not wrapped
    again). Marks ``strategy.evaluation.scored``: its loop shows ``evaluate_fn`` the scored model."""
    strategy.evaluation.scored = True
    if evaluate_fn is None or getattr(evaluate_fn, SCORED, False):
        return evaluate_fn

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        out = evaluate_fn(server_round, strategy.evaluation_arrays(arrays))
        extras = strategy.extra_evaluation_arrays(arrays)
        if not extras:
            return out
        merged = dict(out or {})
        for name, extra in extras.items():
            merged.update({f"{k}-{name}": v for k, v in dict(evaluate_fn(server_round, extra) or {}).items()})
        return MetricRecord(merged)

    setattr(evaluate, SCORED, True)
    return evaluate


def scoring_start(start: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's own ``start`` (its own round loop, e.g. Flower's advanced-pytorch example),
    with its ``evaluate_fn`` argument wrapped by :func:`scored_evaluate_fn` and its ``timeout``
    also the broadcasts' deadline, so the rule is scored as under ``AvailabilityStrategy.start``.
    A ``start`` without an ``evaluate_fn`` parameter is left as it is (the rule then warns)."""
    signature = inspect.signature(start)
    if "evaluate_fn" not in signature.parameters:
        return start

    @functools.wraps(start)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["evaluate_fn"] = scored_evaluate_fn(self, bound.arguments.get("evaluate_fn"))
        if "timeout" in signature.parameters:
            bound.apply_defaults()
            self.evaluation.timeout = float(bound.arguments["timeout"])
        return start(*bound.args, **bound.kwargs)

    setattr(wrapped, SCORED, True)
    return wrapped


class EvaluatedRule(Protocol):
    """What the evaluation part reads of the strategy that holds it: the rule's hooks
    (:class:`strategies.rule.Rule`) and the base's parts (:class:`strategies.base.AvailabilityStrategy`)."""

    @property
    def name(self) -> str: ...
    @property
    def client_rule(self) -> str: ...

    sampling: Sampling
    keys: RecordKeys
    rng: np.random.Generator

    def broadcast_nodes(self, server_round: int) -> list[int]: ...
    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]: ...
    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord: ...
    def extra_evaluation_arrays(self, arrays: ArrayRecord) -> dict[str, ArrayRecord]: ...


class Evaluation:
    """Flower's evaluate round of one strategy (``strategy.evaluation``), and its round-end broadcast."""

    def __init__(self, rule: EvaluatedRule) -> None:
        self.rule = rule
        self.timeout = 3600.0  # the broadcasts' deadline: start()'s timeout
        self.scored = False  # True once a loop shows evaluate_fn the scored model
        self.unscored_warned = False

    @staticmethod
    def adopt_loop(strategy: Any, base_start: Callable[..., Any]) -> None:
        """A strategy whose class has its own ``start`` (a user's loop) gets, on this instance,
        that ``start`` with its ``evaluate_fn`` shown the scored model (:func:`scoring_start`)."""
        own = type(strategy).start
        if own is not base_start and not getattr(own, SCORED, False):
            strategy.start = functools.partial(scoring_start(own), strategy)

    def scores_another_model(self, arrays: ArrayRecord) -> bool:
        """Whether the rule is scored on a model other than x^{t+1} (FedExP: its evaluation_arrays gives
        another record) or adds models (FedAWE)."""
        return self.rule.evaluation_arrays(arrays) is not arrays or bool(self.rule.extra_evaluation_arrays(arrays))

    def warn_unscored(self, server_round: int, arrays: ArrayRecord) -> None:
        """Once: the WARNING that this run's evaluate_fn is not shown the rule's scored model."""
        if self.scored or self.unscored_warned or not self.scores_another_model(arrays):
            return
        self.unscored_warned = True
        flwr_log.warning(
            "%s is scored on another model than x^{t+1} (%s), but this run's loop does not show it to evaluate_fn "
            "(round %d): wrap it, evaluate_fn = strategies.evaluate_round.scored_evaluate_fn(strategy, evaluate_fn), or "
            "give your start() an evaluate_fn parameter (then it is wrapped for you)", self.rule.name,
            "FedExP: the mean of its last two iterates; FedAWE: x-bar, as <metric>-xbar", server_round)

    def broadcast(self, server_round: int, arrays: ArrayRecord) -> list[Message]:
        """The round-end broadcast of ``server_round`` (message type ``train.adopt``): ``arrays``
        to the rule's ``broadcast_nodes``, with its client rule and train config."""
        rule = self.rule
        nodes = rule.broadcast_nodes(server_round)
        if not nodes:
            return []
        config = ConfigRecord({SERVER_ROUND: server_round, CLIENT_RULE: rule.client_rule,
                               **rule.train_config(server_round, nodes)})
        content = rule.keys.content(arrays, config)
        return [Message(content, dst_node_id=n, message_type=ADOPT) for n in nodes]

    def deliver_broadcast(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> None:
        """Send what :meth:`broadcast` has for ``server_round`` and check the replies."""
        messages = self.broadcast(server_round, arrays)
        if messages:
            replies = grid.send_and_receive(messages, timeout=self.timeout)
            check_broadcast(self.rule.name, server_round, messages, list(replies))

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """First the round-end broadcast (FedAWE), then the model the rule is scored on
        (``evaluation_arrays``) to a ``fraction_evaluate`` sample of the connected nodes."""
        rule = self.rule
        self.deliver_broadcast(server_round, arrays, grid)
        self.warn_unscored(server_round, arrays)
        nodes = rule.sampling.sample(sorted(grid.get_node_ids()), False, rule.rng)
        if not nodes:
            return []
        config[SERVER_ROUND] = server_round
        config[CLIENT_RULE] = PLAIN_RULE
        content = rule.keys.content(rule.evaluation_arrays(arrays), config)
        return [Message(content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in nodes]

    def probe(self, server_round: int, arrays: ArrayRecord, probe: Probe, grid: Grid) -> dict[int, dict[str, Any]]:
        """A rule's probe stage (power-of-choice): ``arrays`` to ``probe.nodes`` in evaluate
        messages with ``probe.config``; node -> the metrics of its valid answer (one metric
        record, no error, from a probed node), Flower's metric names made canonical."""
        if not probe.send or not probe.nodes:
            return {}
        config = ConfigRecord({SERVER_ROUND: server_round, CLIENT_RULE: PLAIN_RULE, **probe.config})
        content = self.rule.keys.content(arrays, config)
        sent = [Message(content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in probe.nodes]
        replies = list(grid.send_and_receive(sent, timeout=probe.timeout))
        node_of_message = destinations(sent)
        answers: dict[int, dict[str, Any]] = {}
        for msg in replies:
            node = source_node(msg, node_of_message)
            if node in probe.nodes and not msg.has_error() and len(msg.content.metric_records) == 1:
                answers[node] = canonical(next(iter(msg.content.metric_records.values())), self.rule.keys.weighted_by_key)
        return answers

    def aggregate(self, replies: Iterable[Message]) -> MetricRecord | None:
        """The client metrics of the valid replies: ``evaluate_metrics_aggr_fn``, or every numeric
        metric's mean weighted by ``weighted_by_key`` (Flower's default); None without any."""
        keys = self.rule.keys
        contents = [m.content for m in replies if not m.has_error()]
        if keys.evaluate_metrics_aggr_fn is not None:
            return keys.evaluate_metrics_aggr_fn(contents, keys.weighted_by_key) if contents else None
        return weighted_mean(contents, keys.weighted_by_key)
