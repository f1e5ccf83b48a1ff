"""What ``evaluate_fn`` is shown: the model a rule is scored on, and the other models its paper scores.

Flower's ``Strategy.start`` calls ``evaluate_fn(round, arrays)`` on the global model. Some rules
are scored on another model: FedExP on the mean of its last two iterates (``evaluation_arrays``),
and FedAWE's official code on x̄, the mean of every client's copy (``extra_evaluation_arrays``:
``{"xbar": x̄}``). :func:`scored_evaluate_fn` wraps an ``evaluate_fn`` so that it sees the scored
model, and adds each extra model's metrics under ``<metric>-<name>`` (``accuracy-xbar``), as the
project's ServerApp records ``test-accuracy-xbar``. ``AvailabilityStrategy.start`` applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, MetricRecord

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def scored_evaluate_fn(strategy: Any, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:
    """``evaluate_fn`` run on ``strategy.evaluation_arrays(arrays)`` and on each of
    ``strategy.extra_evaluation_arrays(arrays)`` (None stays None)."""
    if evaluate_fn is None:
        return None

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        out = evaluate_fn(server_round, strategy.evaluation_arrays(arrays))
        extras = strategy.extra_evaluation_arrays(arrays)
        if not extras:
            return out
        merged = dict(out or {})
        for name, extra in extras.items():
            merged.update({f"{k}-{name}": v for k, v in dict(evaluate_fn(server_round, extra) or {}).items()})
        return MetricRecord(merged)

    return evaluate
