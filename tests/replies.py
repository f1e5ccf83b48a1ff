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


# ---------------------------------------------------------------- every rule, honest or not
def build_rule(name: str, n: int = 4, spec: str = "", **kwargs) -> AvailabilityStrategy:
    """Any registered rule with N = n clients (power-of-choice as rpow-d: no probe round to fake;
    oracles get p = 0.5)."""
    from strategies import build_strategy

    spec = spec or ("pow-d:variant=rpow-d" if name == "pow-d" else name)
    return build_strategy(spec, num_clients=n, probabilities=lambda t: np.full(n, 0.5), seed=3, **kwargs)


def rule_reply(name: str, sent: Message, model, client: int, update=None, *, arrays: dict | None = None,
               factor: float = 1.0, **metrics) -> Message:
    """A reply every rule accepts (FedNova's a-norm and num-steps, FedAWE's and FedPBC's echo factor
    and u_i = ``update``, default model − x, SCAFFOLD's Δc_i), unless ``arrays`` (name -> ndarray or Array) replaces entries."""
    from flwr.app import Array, ArrayRecord

    from strategies.protocol import FEDAWE_ECHO_FACTOR, FEDAWE_UPDATE_PREFIX, SCAFFOLD_DC_PREFIX

    model = np.asarray(model, np.float32)
    content: dict = {"w": model}
    if name.startswith(("fedawe", "fedpbc")):
        u = model - sent_model(sent) if update is None else np.asarray(update, np.float32)
        content |= {FEDAWE_ECHO_FACTOR: np.array([factor]), FEDAWE_UPDATE_PREFIX + "w": u}
    if name.startswith(("scaffold", "amplified-scaffold")):  # Δc_i: a model-sized array
        content |= {SCAFFOLD_DC_PREFIX + "w": 0.5 * (model - sent_model(sent))}
    content |= arrays or {}
    record = ArrayRecord({k: v if isinstance(v, Array) else Array(np.ascontiguousarray(v)) for k, v in content.items()})
    metrics = {"num-examples": 10, "client-id": client, "a-norm": 2.0, "num-steps": 2, "lr": 0.1, **metrics}
    return Message(RecordDict({"arrays": record, "metrics": MetricRecord(metrics)}), reply_to=sent)


def sent_model(sent: Message) -> np.ndarray:
    """The global model a train message carries (FedAWE's carry x^0; its tests pass x^t = x^0)."""
    return sent.content["arrays"]["w"].numpy()
