"""What ``evaluate_fn`` is shown: the model a rule is scored on, and the other models its paper scores.

Flower's ``Strategy.start`` calls ``evaluate_fn(round, arrays)`` on the global model. Some rules
are scored on another model: FedExP on the mean of its last two iterates (``evaluation_arrays``),
and FedAWE's official code on x̄, the mean of every client's copy (``extra_evaluation_arrays``:
``{"xbar": x̄}``). :func:`scored_evaluate_fn` wraps an ``evaluate_fn`` so that it sees the scored
model, and adds each extra model's metrics under ``<metric>-<name>`` (``accuracy-xbar``), as the
project's ServerApp records ``test-accuracy-xbar``. ``AvailabilityStrategy.start`` applies it.

:class:`EvaluateRound` is the base's Flower evaluate round: the round-end broadcast (FedAWE's,
which Flower's ``start`` thus delivers right after aggregation), then the scored model to a
``fraction_evaluate`` sample, and the clients' metrics aggregated.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .failures import check_broadcast
from .metrics import weighted_mean
from .options import RecordKeys
from .protocol import ADOPT, CLIENT_RULE, PLAIN_RULE, SERVER_ROUND
from .rule import Rule
from .sampling import Sampling

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
SCORED = "_flchurn_scored"  # marks an evaluate_fn or a start already wrapped here
flwr_log = logging.getLogger("flwr")


def scored_evaluate_fn(strategy: Any, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:
    """``evaluate_fn`` run on ``strategy.evaluation_arrays(arrays)`` and on each of
    ``strategy.extra_evaluation_arrays(arrays)`` (None stays None; a wrapped one is not wrapped
    again). Marks ``strategy.scored_evaluation``: its loop shows ``evaluate_fn`` the scored model."""
    strategy.scored_evaluation = True
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
            self.message_timeout = float(bound.arguments["timeout"])
        return start(*bound.args, **bound.kwargs)

    setattr(wrapped, SCORED, True)
    return wrapped


class EvaluateRound(Rule, Strategy):
    """The evaluate half of Flower's round for :class:`strategies.base.AvailabilityStrategy`,
    which holds the train half and sets the parts declared here; the rule's hooks come from
    :class:`Rule`.

    A user's subclass with its own ``start`` loop (``class Mine(FedExP)``) gets it wrapped by
    :func:`scoring_start`; a loop that calls ``evaluate_fn`` some other way must pass it through
    ``scored_evaluate_fn(strategy, evaluate_fn)``, else the rule says at WARNING, once, that its
    ``evaluate_fn`` sees x^{t+1} and not the rule's scored model.
    """

    sampling: Sampling
    keys: RecordKeys
    rng: np.random.Generator
    message_timeout: float  # the broadcasts' deadline (start's timeout)
    scored_evaluation = False  # True once a loop shows evaluate_fn the scored model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("start")
        if own is not None and not getattr(own, SCORED, False):
            cls.start = scoring_start(own)  # type: ignore[method-assign]

    def scores_another_model(self, arrays: ArrayRecord) -> bool:
        """Whether the rule is scored on a model other than x^{t+1} (FedExP) or adds models (FedAWE)."""
        plain = type(self).evaluation_arrays is Rule.evaluation_arrays
        return not plain or bool(self.extra_evaluation_arrays(arrays))

    def warn_unscored(self, server_round: int, arrays: ArrayRecord) -> None:
        """Once: the WARNING that this run's evaluate_fn is not shown the rule's scored model."""
        if self.scored_evaluation or getattr(self, "_unscored_warned", False) or not self.scores_another_model(arrays):
            return
        self._unscored_warned = True
        flwr_log.warning(
            "%s is scored on another model than x^{t+1} (%s), but this run's loop does not show it to evaluate_fn "
            "(round %d): wrap it, evaluate_fn = strategies.evaluate_round.scored_evaluate_fn(strategy, evaluate_fn), or "
            "give your start() an evaluate_fn parameter (then it is wrapped for you)", self.name,
            "FedExP: the mean of its last two iterates; FedAWE: x-bar, as <metric>-xbar", server_round)

    def configure_broadcast(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> list[Message]:
        """The round-end broadcast of ``server_round`` (message type ``train.adopt``): ``arrays``
        to the rule's :meth:`broadcast_nodes`, with its client rule and train config."""
        nodes = self.broadcast_nodes(server_round)
        if not nodes:
            return []
        config = ConfigRecord({SERVER_ROUND: server_round, CLIENT_RULE: self.client_rule,
                               **self.train_config(server_round, nodes)})
        content = self.keys.content(arrays, config)
        return [Message(content, dst_node_id=n, message_type=ADOPT) for n in nodes]

    def deliver_broadcast(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> None:
        """Send what :meth:`configure_broadcast` has for ``server_round`` and check the replies."""
        messages = self.configure_broadcast(server_round, arrays, grid)
        if messages:
            replies = grid.send_and_receive(messages, timeout=self.message_timeout)
            check_broadcast(self.name, server_round, messages, list(replies))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """First the round-end broadcast (FedAWE), then the model the rule is scored on
        (:meth:`evaluation_arrays`) to a ``fraction_evaluate`` sample of the connected nodes."""
        self.deliver_broadcast(server_round, arrays, grid)
        self.warn_unscored(server_round, arrays)
        nodes = self.sampling.sample(sorted(grid.get_node_ids()), False, self.rng)
        if not nodes:
            return []
        config[SERVER_ROUND] = server_round
        config[CLIENT_RULE] = PLAIN_RULE
        content = self.keys.content(self.evaluation_arrays(arrays), config)
        return [Message(content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The client metrics of the valid replies: ``evaluate_metrics_aggr_fn``, or every numeric
        metric's mean weighted by ``weighted_by_key`` (Flower's default); None without any."""
        contents = [m.content for m in replies if not m.has_error()]
        if self.keys.evaluate_metrics_aggr_fn is not None:
            return self.keys.evaluate_metrics_aggr_fn(contents, self.keys.weighted_by_key) if contents else None
        return weighted_mean(contents, self.keys.weighted_by_key)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: EvaluateFn | None = None) -> Any:
        """Flower's ``Strategy.start``, with ``timeout`` also the broadcasts' deadline and
        ``evaluate_fn`` shown the model the rule is scored on (:func:`scored_evaluate_fn`)."""
        self.message_timeout = float(timeout)
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                             scored_evaluate_fn(self, evaluate_fn))
