"""Mocked train messages and replies for strategy tests (real flwr Messages, no grid)."""

from __future__ import annotations

import uuid

import numpy as np
from flwr.app import Error, Message, MessageType, MetricRecord, RecordDict

from strategies import AvailabilityStrategy, named_arrays


class Grid1:
    """The smallest grid configure_train needs: a list of node ids (messages sent through it, such
    as FedAWE's round-end broadcast, are recorded and get no reply)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.sent = []

    def get_node_ids(self):
        return self.nodes

    def send_and_receive(self, messages, *, timeout=None):
        self.sent += list(messages)
        return []


def start_round(strategy: AvailabilityStrategy, rnd: int, x: np.ndarray, nodes) -> dict[int, Message]:
    """configure_train with global model ``x`` (one array 'w'); returns node -> sent message."""
    from flwr.app import ConfigRecord

    sent = list(strategy.configure_train(rnd, named_arrays({"w": np.asarray(x, np.float32)}), ConfigRecord(), Grid1(nodes)))
    for m in sent:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return {m.metadata.dst_node_id: m for m in sent}


def reply(sent: Message, model, extra_arrays: dict | None = None, **metrics) -> Message:
    """A training reply: ``model`` as array 'w' (plus ``extra_arrays``) and the metrics."""
    metrics = {"num-examples": 10, **metrics}
    arrays = {"w": np.asarray(model, np.float32), **(extra_arrays or {})}
    content = RecordDict({"arrays": named_arrays(arrays), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=sent)


def error(sent: Message, code: int = 1000, from_superlink: bool = False) -> Message:
    msg = Message(Error(code=code, reason="unavailable"), reply_to=sent)
    if from_superlink:
        msg.metadata.__dict__["_src_node_id"] = 1
    return msg


def run_round(strategy, rnd, x, updates: dict[int, np.ndarray], nodes=None, **metrics):
    """One round where client c (node 100+c) replies x + updates[c]; returns the new x."""
    nodes = nodes if nodes is not None else [100 + c for c in updates]
    sent = start_round(strategy, rnd, x, nodes)
    replies = [reply(sent[100 + c], np.asarray(x) + d, **{"client-id": c, **metrics}) for c, d in updates.items()]
    arrays, _ = strategy.aggregate_train(rnd, replies)
    return arrays["w"].numpy()


__all__ = ["Grid1", "start_round", "reply", "error", "run_round", "MessageType"]
