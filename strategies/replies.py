"""Training replies -> :class:`ClientReport`: parsing and validation, one reply at a time.

A reply is one ArrayRecord (the client's model x_i^{t,end}) and one MetricRecord. It becomes a
:class:`ClientReport` (Δ_i = x_i − x^t as one flat float32 vector, counts, a-norm, loss) or a
:class:`ReplyRejected` naming the problem. :class:`ReplyParser` holds a rule's requirements
(which metrics, client ids, count ranges); the metric readers (:func:`count`, :func:`finite`,
:func:`positive`) are shared with every other reader of client metrics (power-of-choice's probe,
MIFA's lr). :func:`source_node` traces a SuperLink-relayed error back to its node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from .layout import Layout
from .metrics import canonical, names
from .protocol import A_NORM, CLIENT_ID, NUM_EXAMPLES, NUM_STEPS, TRAIN_LOSS

SUPERLINK_NODE_ID = 1  # src_node_id of errors the SuperLink writes on a node's behalf


class ReplyRejected(ValueError):
    """A reply that must not reach the model; the message says why."""


@dataclass
class ClientReport:
    """One valid training reply, as the rules see it."""

    client_id: int
    node_id: int
    delta: np.ndarray  # Δ_i = x_i^{t,end} − x^t, flat float32 (the server ADDS it)
    num_examples: int
    num_steps: int | None = None
    a_norm: float | None = None  # FedNova's ‖a_i‖_1
    train_loss: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    integers: dict[str, np.ndarray] = field(default_factory=dict)  # the non-floating arrays, exact


@dataclass
class RoundLog:
    """Who did what in one round, for the ServerApp's per-round record."""

    sent: list[int] = field(default_factory=list)  # node ids addressed
    participants: list[int] = field(default_factory=list)  # client ids of valid replies
    unavailable: list[int] = field(default_factory=list)  # node ids: error or no reply
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (node id, reason)


# ----------------------------------------------------------------------- metric readers
def count(metrics: Mapping[str, Any], key: str, low: int, high: int, default: Any = ReplyRejected) -> Any:
    """``metrics[key]`` as an integer in [low, high] (an integral float is accepted); ``default``
    when absent (ReplyRejected when no default)."""
    if key not in metrics:
        if default is ReplyRejected:
            raise ReplyRejected(f"metric '{key}' missing")
        return default
    value = metrics[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReplyRejected(f"metric '{key}'={value!r} is not an integer in [{low}, {high}]")
    return value


def finite(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a finite float (not a bool), None when absent."""
    if key not in metrics:
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplyRejected(f"metric '{key}'={value!r} is not a finite number")
    return float(value)


def positive(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a finite float > 0, None when absent."""
    value = finite(metrics, key)
    if value is not None and value <= 0:
        raise ReplyRejected(f"metric '{key}'={value!r} must be > 0")
    return value


# ------------------------------------------------------------------------ messages
def source_node(msg: Message, node_of_message: Mapping[str, int]) -> int:
    """The node a reply speaks for: its sender, or for an error the SuperLink wrote on a node's
    behalf (``src_node_id == 1``), the node the replied-to message went to."""
    node = msg.metadata.src_node_id
    if node == SUPERLINK_NODE_ID:
        node = node_of_message.get(msg.metadata.reply_to_message_id, node)
    return node


def destinations(sent: Iterable[Message]) -> dict[str, int]:
    """message id -> destination node, for :func:`source_node`."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in sent}


def split(content: RecordDict) -> tuple[str, ArrayRecord, dict[str, Any]]:
    """A reply's (array record name, ArrayRecord, metrics), or ReplyRejected."""
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise ReplyRejected(
            f"expected one ArrayRecord and one MetricRecord, got "
            f"{list(content.array_records)} and {list(content.metric_records)}"
        )
    name, arrays = next(iter(content.array_records.items()))
    return name, arrays, dict(next(iter(content.metric_records.values())))


@dataclass(frozen=True)
class ReplyParser:
    """A rule's requirements on a training reply.

    rule : the rule's name (in reasons).
    required : metrics every reply must carry; ``hints`` gives a missing one's own reason.
    needs_client_ids : the rule keeps per-client rows 0..N-1 (informational: ``fallback`` decides).
    num_clients : N; a client id must lie in [0, N) (any id >= 0 when None).
    max_num_examples, max_num_steps : replies claiming more are absurd.
    weighted_by_key : where ``num-examples`` is read (Flower's argument of that name).
    fallback : the client id of a reply that reports none, given its node (rules with per-client
        rows: a row of their own, or ReplyRejected); None: the node id.

    Metrics are read under the project's names or Flower's (:func:`strategies.metrics.canonical`).
    """

    rule: str
    required: tuple[str, ...] = (NUM_EXAMPLES,)
    hints: Mapping[str, str] = field(default_factory=dict)
    needs_client_ids: bool = False
    num_clients: int | None = None
    max_num_examples: int = 10**9
    max_num_steps: int = 10**7
    weighted_by_key: str = NUM_EXAMPLES
    fallback: Callable[[int], int] | None = None

    def parse(self, content: RecordDict, node: int, layout: Layout, current: np.ndarray) -> ClientReport:
        """One reply's content -> ClientReport, or ReplyRejected naming the problem."""
        _, arrays, metrics = split(content)
        return self.report(arrays, metrics, node, layout, current)

    def report(self, arrays: ArrayRecord, metrics: dict[str, Any], node: int, layout: Layout,
               current: np.ndarray) -> ClientReport:
        """The model ``arrays`` and ``metrics`` of one reply -> ClientReport (or ReplyRejected)."""
        metrics = canonical(metrics, self.weighted_by_key)
        for key, hint in self.hints.items():
            if key not in metrics:
                raise ReplyRejected(hint)
        missing = [k for k in self.required if k not in metrics]
        if missing:
            said = ", ".join(f"'{self.weighted_by_key}'" if k == NUM_EXAMPLES else names(k) for k in missing)
            raise ReplyRejected(f"the train reply lacks metric {said}, which strategy '{self.rule}' "
                                f"needs: add it to the ClientApp's train reply MetricRecord")
        if (why := layout.mismatch(arrays)) is not None:
            raise ReplyRejected(why)
        model = layout.flatten(arrays)
        if not np.all(np.isfinite(model)):
            raise ReplyRejected("arrays contain NaN or Inf")
        try:
            integers = layout.integers(arrays)
        except ValueError as exc:
            raise ReplyRejected(str(exc)) from None
        if CLIENT_ID in metrics:
            client_id = count(metrics, CLIENT_ID, 0, (self.num_clients or 2**63) - 1)
        else:
            client_id = node if self.fallback is None else self.fallback(node)
        return ClientReport(
            client_id=client_id,
            node_id=node,
            delta=model - current,
            num_examples=count(metrics, NUM_EXAMPLES, 1, self.max_num_examples),
            num_steps=count(metrics, NUM_STEPS, 1, self.max_num_steps, default=None),
            a_norm=positive(metrics, A_NORM),
            train_loss=finite(metrics, TRAIN_LOSS),
            metrics=metrics,
            integers=integers,
        )
