"""The ClientApp called directly with real messages."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from availability import build_schedule
from client_app.app import UNAVAILABLE, app, workload_of
from experiments.inprocess import default_run_config
from runconfig import ConfigError, WorkloadConfig, from_run_config
from workloads.workload import get_workload

RUN_CONFIG = {**default_run_config(), "num-clients": 6, "local-steps": "steps:n=4",
              "availability": "staircase:period=4,low=0.3"}


def context(pid, run_config=RUN_CONFIG, **node):
    return Context(run_id=1, node_id=50 + pid, state=RecordDict(), run_config=dict(run_config),
                   node_config={"partition-id": pid, "num-partitions": 6, **node})


def train_message(rnd):
    wl = get_workload(from_run_config(WorkloadConfig, RUN_CONFIG))
    arrays = ArrayRecord(wl.new_model().state_dict())
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd})})
    msg = Message(content, dst_node_id=52, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = "m"
    return msg, arrays


def test_train_reply_carries_arrays_and_every_metric_a_rule_needs():
    msg, sent = train_message(1)
    reply = app(msg, context(2))
    metrics = reply.content["metrics"]
    wl, _ = workload_of(context(2))
    assert metrics["client-id"] == 2
    assert metrics["num-examples"] == len(wl.parts[2]) > 0
    assert metrics["num-steps"] == 4 and metrics["a-norm"] == pytest.approx(4.0)  # plain SGD: ‖a‖_1 = τ
    assert np.isfinite(metrics["train-loss"])
    got = reply.content["arrays"]
    assert list(got.keys()) == list(sent.keys())
    assert any(not np.array_equal(a, b) for a, b in zip(got.to_numpy_ndarrays(), sent.to_numpy_ndarrays(), strict=True))


def test_client_gate_declines_exactly_when_the_schedule_says_offline():
    gated = {**RUN_CONFIG, "availability-gate": "client"}
    wl = get_workload(from_run_config(WorkloadConfig, gated))
    schedule = build_schedule(gated["availability"], 6, 0, label_dists=wl.label_dists)
    seen = set()
    for rnd in range(1, 9):
        msg, _ = train_message(rnd)
        for pid in range(6):
            reply = app(msg, context(pid, gated))
            online = schedule.is_available(pid, rnd - 1)
            seen.add(online)
            assert reply.has_error() == (not online)
            if not online:
                assert reply.error.code == UNAVAILABLE
    assert seen == {True, False}


def test_the_partition_is_built_once_per_process():
    a, _ = workload_of(context(0))
    b, _ = workload_of(context(5))
    assert a is b


def test_node_config_must_name_the_partition_and_agree_with_num_clients(tmp_path):
    bare = Context(run_id=1, node_id=1, state=RecordDict(), run_config=RUN_CONFIG, node_config={})
    with pytest.raises(ConfigError, match="partition-id"):
        workload_of(bare)
    wrong = Context(run_id=1, node_id=1, state=RecordDict(), run_config=RUN_CONFIG,
                    node_config={"partition-id": 0, "num-partitions": 4})
    with pytest.raises(ConfigError, match="num-partitions=4"):
        workload_of(wrong)


def test_node_config_data_dir_overrides_the_run_config(tmp_path):
    mnist = {**RUN_CONFIG, "dataset": "mnist", "data-dir": "/nonexistent"}
    with pytest.raises(ValueError, match=str(tmp_path)):
        workload_of(context(0, mnist, **{"data-dir": str(tmp_path)}))
