"""The ServerApp's own reading of replies never ends a run (issue 27, item 7).

What the strategy's checks do not cover: the per-client ``train-time`` record, the identity a node
states in discovery, the availability grid's client ids; replies matched to this round's
messages; a hostile value summarised, not echoed, in logs and ``metrics.jsonl``.
"""

import json
import logging
import math
import uuid

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from availability import schedule_for
from experiments.inprocess import NODE_ID_BASE, default_run_config, run_inprocess
from server_app.experiment import MAX_TRAIN_TIME, client_train_times
from server_app.network import AvailabilityGrid, discover_clients
from server_app.results import METRICS, read_metrics
from strategies.replies import REASON_CHARS, shown

SMALL = {"num-clients": 4, "num-server-rounds": 3, "local-steps": "steps:n=2", "progress": False,
         "availability": "always", "checkpoint-every": 0, "eval-every": 0}


def sent_to(node: int, message_type=MessageType.TRAIN) -> Message:
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=node,
                  message_type=message_type)
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return msg


def answer(msg: Message, metrics: dict | None = None, error: bool = False, **records) -> Message:
    if error:
        return Message(Error(code=1000, reason="gone"), reply_to=msg)
    content = RecordDict({"metrics": MetricRecord(metrics or {}), **records})
    return Message(content, reply_to=msg)


# ------------------------------------------------------------------ train-time record
HOSTILE_TIMES = [math.nan, math.inf, -math.inf, -1.0, MAX_TRAIN_TIME * 10, [1.0], [1.0] * 1000, 1e308]


@pytest.mark.parametrize("value", HOSTILE_TIMES, ids=repr)
def test_a_hostile_train_time_is_left_out_and_the_others_kept(value):
    sent = [sent_to(100), sent_to(101)]
    replies = [answer(sent[0], {"train-time": 1.25, "client-id": 0}),
               answer(sent[1], {"train-time": value, "client-id": 1})]
    got = client_train_times(replies, sent, [0, 1], {0: 100, 1: 101})
    assert got == {"client-train-time": {"0": 1.25}}


@pytest.mark.parametrize("client_id", [math.nan, math.inf, [0], 1e300, -1], ids=repr)
def test_the_reply_s_own_client_id_is_not_read_the_accepted_binding_is(client_id):
    sent = [sent_to(100)]
    replies = [answer(sent[0], {"train-time": 2.0, "client-id": client_id})]
    assert client_train_times(replies, sent, [3], {3: 100}) == {"client-train-time": {"3": 2.0}}


def test_only_replies_to_this_round_s_messages_from_the_accepted_node_are_timed():
    old, sent = sent_to(100), [sent_to(100), sent_to(101)]
    replies = [answer(old, {"train-time": 9.0}),  # a reply to another round's message
               answer(sent[0], {"train-time": 1.0}),
               answer(sent[1], {"train-time": 2.0}),
               answer(sent_to(102), {"train-time": 3.0})]  # a node not addressed this round
    # client 1's accepted node is 102 (not 101): 101's reply does not speak for it
    got = client_train_times(replies, sent, [0, 1, 2], {0: 100, 1: 102, 2: 101})
    assert got == {"client-train-time": {"0": 1.0, "2": 2.0}}
    assert client_train_times([answer(sent[0], error=True)], sent, [0], {0: 100}) == {}
    two = RecordDict({"a": MetricRecord({"train-time": 1.0}), "b": MetricRecord({"train-time": 2.0})})
    assert client_train_times([Message(two, reply_to=sent[0])], sent, [0], {0: 100}) == {}


# ------------------------------------------------------------------------- discovery
class QueryGrid:
    """Answers each QUERY with ``answers[node](query)`` (None: no reply)."""

    def __init__(self, answers):
        self.answers = answers
        self.asked: list[int] = []

    def get_node_ids(self):
        return list(self.answers)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.asked.append(m.metadata.dst_node_id)
            reply = self.answers[m.metadata.dst_node_id](m)
            if reply is not None:
                out.append(reply)
        return out


def states(value=None, record=None):
    def make(query):
        rec = record if record is not None else MetricRecord({"client-id": value, "num-partitions": 4})
        return Message(RecordDict({"identity": rec}), reply_to=query)
    return make


BAD_IDENTITIES = {
    "nan": states(math.nan), "inf": states(math.inf), "list": states([1, 2]), "negative": states(-3),
    "fraction": states(1.5), "huge-list": states(list(range(10**5))),
    "config-string": states(record=ConfigRecord({"client-id": "x" * 10**5})),
    "config-bool": states(record=ConfigRecord({"client-id": True})),
    "arrays": states(record=ArrayRecord()),
    "no-identity": lambda q: Message(RecordDict({"other": MetricRecord({"client-id": 1})}), reply_to=q),
}


@pytest.mark.parametrize("kind", sorted(BAD_IDENTITIES))
def test_discovery_refuses_a_bad_identity_without_raising(kind, caplog):
    grid = QueryGrid({10: states(0), 11: BAD_IDENTITIES[kind], 12: states(2)})
    refused: set[int] = set()
    with caplog.at_level(logging.WARNING):
        known = discover_clients(grid, {}, 1.0, refused)
    assert known == {10: 0, 12: 2} and refused == {11}
    assert "node 11 did not say which client it is" in caplog.text
    assert max(len(r.getMessage()) for r in caplog.records) < 400  # summarised, not echoed
    discover_clients(grid, known, 1.0, refused)
    assert grid.asked == [10, 11, 12]  # a refused node is not asked again


def test_discovery_ignores_a_reply_to_another_query_and_asks_a_silent_node_again():
    stray = sent_to(99, MessageType.QUERY)
    grid = QueryGrid({10: lambda q: Message(RecordDict({"identity": MetricRecord({"client-id": 3})}), reply_to=stray),
                      11: lambda q: None, 12: lambda q: answer(q, error=True)})
    refused: set[int] = set()
    assert discover_clients(grid, {}, 1.0, refused) == {} and refused == set()
    discover_clients(grid, {}, 1.0, refused)
    assert grid.asked == [10, 11, 12, 10, 11, 12]


class Inner(QueryGrid):
    """Answers QUERYs (identities) and records the other messages it is asked to deliver."""

    def __init__(self, answers):
        super().__init__(answers)
        self.delivered: list[int] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        queries = [m for m in messages if m.metadata.message_type.startswith(MessageType.QUERY)]
        self.delivered += [m.metadata.dst_node_id for m in messages if m not in queries]
        return super().send_and_receive(queries, timeout=timeout)


def test_the_availability_grid_withholds_from_a_node_with_an_out_of_range_client_id_and_logs_once(caplog):
    schedule = schedule_for({**default_run_config(), **SMALL})
    inner = Inner({10: states(0), 11: states(99), 12: states(math.nan)})
    grid = AvailabilityGrid(inner, schedule, {}, 1.0)
    with caplog.at_level(logging.WARNING):
        for rnd in (1, 2):
            grid.send_and_receive([train(10, rnd), train(11, rnd), train(12, rnd)])  # never raises
    assert inner.delivered == [10, 10]  # fail closed: 11 states a client the schedule lacks, 12 none
    assert caplog.text.count("outside the schedule's clients") == 1
    assert inner.asked == [10, 11, 12]  # 12 refused, 11 known (out of range): neither asked again


def train(node: int, rnd: int) -> Message:
    return Message(RecordDict({"config": ConfigRecord({"server-round": rnd})}), dst_node_id=node,
                   message_type=MessageType.TRAIN)


# ------------------------------------------------------------- a whole run, one hostile node
def hostile_client_app(corrupt):
    """The real ClientApp, with partition 1's train replies changed by ``corrupt(metrics)``."""
    from client_app.app import app

    def call(msg, context):
        reply = app(msg, context)
        if msg.metadata.message_type == MessageType.TRAIN and context.node_config["partition-id"] == 1 \
                and not reply.has_error():
            metrics = next(iter(reply.content.metric_records.values()))
            corrupt(metrics)
        return reply
    return call


@pytest.mark.parametrize("bad", [{"train-time": math.nan}, {"train-time": [1.0]}, {"train-time": math.inf},
                                 {"client-id": math.nan}, {"num-examples": list(range(10**6))}],
                         ids=lambda d: shown(d, 30))
def test_a_run_survives_one_hostile_node_and_its_record_stays_small(tmp_path, bad):
    def corrupt(metrics):
        metrics.update(bad)
        metrics["train-time"] = metrics.get("train-time", 0.5)
    run_dir = run_inprocess({**default_run_config(), **SMALL, "strategy": "fedavg-active",
                             "results-dir": str(tmp_path), "run-name": "r"},
                            client_app=hostile_client_app(corrupt))
    rows = read_metrics(run_dir)
    assert len(rows) == SMALL["num-server-rounds"]
    assert max(len(line) for line in (run_dir / METRICS).read_text().splitlines()) < 4000
    for row in rows:
        assert 0 in row["participants"] and 2 in row["participants"]
        times = row.get("client-train-time", {})
        assert all(np.isfinite(v) for v in times.values()) and json.dumps(times)
        if "num-examples" in bad or "client-id" in bad:
            assert 1 not in row["participants"] and [n for n, _ in row["rejected"]] == [NODE_ID_BASE + 1]
            assert all(len(why) <= REASON_CHARS + 20 for _, why in row["rejected"])
        else:  # the reply is accepted; only its time is left out
            assert 1 in row["participants"] and "1" not in times


# ------------------------------------------------------------- federated evaluation metrics
def evaluate_reply(metrics: dict) -> RecordDict:
    return RecordDict({"metrics": MetricRecord(metrics)})


@pytest.mark.parametrize("hostile", [
    {"num-examples": 10**10, "eval-loss": 1e308},  # a weight beyond 1e9
    {"num-examples": 10, "eval-loss": 1e308},  # a value beyond 1e12 (1e308 x a weight: inf)
    {"num-examples": 10, **{f"m{i}": 1.0 for i in range(10**4)}},  # 10^4 new columns
    {"num-examples": 10, "x" * 10**4: 1.0},  # a 10^4-character name
], ids=["weight", "value", "many-keys", "long-name"])
def test_a_hostile_evaluate_reply_cannot_skew_or_bloat_the_federated_metrics(hostile):
    from strategies.metrics import weighted_mean

    honest = [evaluate_reply({"num-examples": 10, "eval-loss": 1.0}), evaluate_reply({"num-examples": 30, "eval-loss": 2.0})]
    got = weighted_mean([*honest, evaluate_reply(hostile)], "num-examples")
    assert dict(got) == {"eval-loss": pytest.approx(1.75)}
