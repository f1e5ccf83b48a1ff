"""benchmarks/ray_path.py's comparison is of the same work: the plain Flower app's ClientApp
(benchmarks/plain_flower_app) trains, from the same message, exactly the model the project's
ClientApp trains; and its per-round figures are the marks' differences."""

from __future__ import annotations

import sys

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from benchmarks import ray_path
from client_app import app as project_client
from runconfig.defaults import default_run_config

sys.path.insert(0, str(ray_path.PLAIN_APP))  # the plain app is a Flower app folder, not a package of ours
from plainfedavg import client_app as plain_client  # noqa: E402
from plainfedavg.task import workload  # noqa: E402


def context(run_config: dict, client: int) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": client, "num-partitions": 100},
                   state=RecordDict(), run_config=run_config)


@pytest.mark.parametrize("client, server_round", [(3, 2), (71, 9)])
def test_the_plain_apps_client_trains_the_projects_model_bit_for_bit(client, server_round):
    plain = {**ray_path.PLAIN, "num-server-rounds": 12}
    start = ArrayRecord(workload(plain).new_model().state_dict())

    def message() -> Message:
        return Message(RecordDict({"arrays": start, "config": ConfigRecord({"server-round": server_round})}),
                       dst_node_id=7, message_type=MessageType.TRAIN)

    theirs = plain_client.train(message(), context(plain, client))
    ours = project_client.train(message(), context({**default_run_config(), **ray_path.FLCHURN}, client))
    a, b = (r.content["arrays"].to_torch_state_dict() for r in (theirs, ours))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert theirs.content["metrics"]["num-examples"] == ours.content["metrics"]["num-examples"]
    assert not all(a[k].equal(v) for k, v in start.to_torch_state_dict().items())  # it trained


def test_the_figures_are_the_marks_differences():
    marks = {1: (20.0, 30.0), 2: (21.0, 31.0), **{r: (21.0 + 0.5 * (r - 2), 31.0 + 0.25 * (r - 2)) for r in range(3, 11)}}
    fig = ray_path.figures(marks, rounds=10)  # rounds 3..9 timed, from the end of round 2 to the end of 9
    assert fig["wall"] == pytest.approx(0.5) and fig["cpu"] == pytest.approx(0.25)
    assert fig["start_wall"] == pytest.approx(19.5) and fig["start_cpu"] == pytest.approx(29.75)
