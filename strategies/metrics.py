"""Client metrics under either naming: the project's and Flower's; their mean over replies.

This project's ClientApp says ``train-loss``, ``eval-loss``, ``eval-accuracy`` and ``client-id``;
Flower's templates say ``train_loss``, ``eval_loss`` and ``eval_acc``, and an app may report its
``partition-id``. :func:`canonical` gives a reply's metrics under the project's names (the
project's name wins where both are present), so every reader (reply parsing, power-of-choice's
probe) accepts both. :func:`weighted_mean` is Flower's default metric aggregation (the mean
weighted by ``weighted_by_key``), tolerant of replies whose keys differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import MetricRecord, RecordDict

from .protocol import CLIENT_ID, EVAL_ACCURACY, EVAL_LOSS, NUM_EXAMPLES, TRAIN_LOSS

ALIASES: dict[str, tuple[str, ...]] = {
    CLIENT_ID: (CLIENT_ID, "client_id", "partition-id", "partition_id"),
    TRAIN_LOSS: (TRAIN_LOSS, "train_loss"),
    EVAL_LOSS: (EVAL_LOSS, "eval_loss"),
    EVAL_ACCURACY: (EVAL_ACCURACY, "eval_acc", "eval_accuracy"),
}
IDENTITY_KEYS = frozenset(ALIASES[CLIENT_ID])  # never averaged


def names(metric: str) -> str:
    """'a' or 'a' (or Flower's 'b'): how a reason names a metric the reply lacks."""
    others = [a for a in ALIASES.get(metric, (metric,)) if a != metric]
    return f"'{metric}'" + (f" (or {', '.join(repr(a) for a in others)})" if others else "")


def canonical(metrics: Mapping[str, Any], weighted_by_key: str = NUM_EXAMPLES) -> dict[str, Any]:
    """``metrics`` with each known metric also under the project's name, and ``num-examples``
    read from ``weighted_by_key`` (Flower's weight key)."""
    out = dict(metrics)
    for name, aliases in ALIASES.items():
        if name not in out:
            found = next((a for a in aliases if a in out), None)
            if found is not None:
                out[name] = out[found]
    if weighted_by_key != NUM_EXAMPLES:
        out.pop(NUM_EXAMPLES, None)
        if weighted_by_key in metrics:
            out[NUM_EXAMPLES] = metrics[weighted_by_key]
    return out


def carries_client_id(content: RecordDict) -> bool:
    """Whether a reply's metrics name its client (under any of the client id's names)."""
    return any(any(a in m for a in ALIASES[CLIENT_ID]) for m in content.metric_records.values())


def claimed_client_id(content: RecordDict) -> float:
    """The client id a reply's metrics claim (under any of its names), unchecked; inf when none
    is an integer (a key to sort replies by, never an accepted id: parsing checks it)."""
    try:
        for m in content.metric_records.values():
            for a in ALIASES[CLIENT_ID]:
                value = m.get(a)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    return float(value)
    except Exception:  # noqa: BLE001 (a malformed reply: parsing rejects it with the reason)
        pass
    return math.inf


MAX_EVAL_METRICS = 32  # an evaluate reply with more metrics (or a longer name) is not averaged
MAX_METRIC_NAME = 64
MAX_METRIC_VALUE = 1e12  # |value| beyond: left out (no float64 sum of weight x value overflows)
MAX_WEIGHT = 10**9  # the weight (num-examples) as a training reply's


def _number(value: Any, limit: float = MAX_METRIC_VALUE) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) > limit:
        return None
    return float(value)


def weighted_mean(contents: Iterable[RecordDict], weighted_by_key: str) -> MetricRecord | None:
    """Every numeric metric's mean over the replies that carry it, weighted by ``weighted_by_key``
    (which is left out, as are client ids); replies without a weight in (0, 1e9] are skipped, as
    are replies with more than ``MAX_EVAL_METRICS`` metrics or a name longer than
    ``MAX_METRIC_NAME`` (a hostile reply cannot add columns to every round's record), and values
    that are not finite or beyond ``MAX_METRIC_VALUE``. None when no reply has a weight."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    weighted = False
    for content in contents:
        if len(content.metric_records) != 1:
            continue
        metrics = next(iter(content.metric_records.values()))
        w = _number(metrics.get(weighted_by_key), MAX_WEIGHT)
        if w is None or w <= 0 or len(metrics) > MAX_EVAL_METRICS or any(len(k) > MAX_METRIC_NAME for k in metrics):
            continue
        weighted = True
        for key, value in metrics.items():
            v = _number(value)
            if key == weighted_by_key or key in IDENTITY_KEYS or v is None:
                continue
            sums[key] = sums.get(key, 0.0) + w * v
            weights[key] = weights.get(key, 0.0) + w
    if not weighted:
        return None
    return MetricRecord({k: sums[k] / weights[k] for k in sums})
