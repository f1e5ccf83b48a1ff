"""Flower's record keys and metric functions (``FedAvg``'s arguments of those names), checked.

``weighted_by_key``: where a reply's example count is read (the data-size weight, and the weight
of client metric means); ``arrayrecord_key`` / ``configrecord_key``: the names of the model and
config records in the messages a strategy sends; ``train_metrics_aggr_fn`` /
``evaluate_metrics_aggr_fn``: ``(list[RecordDict], weighted_by_key) -> MetricRecord``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from .protocol import NUM_EXAMPLES

MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


@dataclass(frozen=True)
class RecordKeys:
    """Flower's keys and metric functions, with Flower's defaults."""

    weighted_by_key: str = NUM_EXAMPLES
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    train_metrics_aggr_fn: MetricsAggrFn | None = None
    evaluate_metrics_aggr_fn: MetricsAggrFn | None = None

    def __post_init__(self) -> None:
        for key in ("weighted_by_key", "arrayrecord_key", "configrecord_key"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key} must be a non-empty string (Flower's record key), got {value!r}")
        if self.arrayrecord_key == self.configrecord_key:
            raise ValueError(f"arrayrecord_key and configrecord_key must differ, both are {self.arrayrecord_key!r}")
        for key in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
            fn = getattr(self, key)
            if fn is not None and not callable(fn):
                raise ValueError(f"{key} must be a callable (list[RecordDict], str) -> MetricRecord, got {fn!r}")

    def content(self, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """A message's content: the model and the config under Flower's keys."""
        return RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
