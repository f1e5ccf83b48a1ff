"""Every spec the drop-in takes is checked where it is first received, before any message goes out,
with the closest known name suggested (issue 50), and the launcher checks the app's schedule before
any process starts; the client-id the rules with per-client state need comes with the churn line."""

import logging

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from availability.base import ScheduleError
from client_app.dropin import availability_mod
from runconfig import key_error
from server_app.dropin import with_availability
from strategies import build_strategy
from strategies.client_binding import ClientBinding


class NoGrid:
    """A grid that fails the test when anything is asked of it: the checks come first."""

    def __getattr__(self, name):
        raise AssertionError(f"the grid was used ({name}) before the spec was checked")


def test_a_misspelt_schedule_strategy_gate_or_stage_is_refused_before_any_message_naming_the_closest():
    with pytest.raises(ScheduleError, match=r"unknown availability model 'bernouli' \(did you mean 'bernoulli'\?\)"):
        with_availability(NoGrid(), "bernouli:p=0.5", num_clients=4)
    with pytest.raises(ValueError, match=r"got 'sever' \(did you mean 'server'\?\)"):
        with_availability(NoGrid(), "always", num_clients=4, gate="sever")
    with pytest.raises(ValueError, match=r"'unmsak' \(did you mean 'unmask'\?\)"):
        with_availability(NoGrid(), "always", num_clients=4, departures={(1, 0): "unmsak"})
    with pytest.raises(ValueError, match=r"unknown strategy 'fedua' \(did you mean 'fedau'\?\)"):
        build_strategy("fedua")
    with pytest.raises(ScheduleError) as far:
        with_availability(NoGrid(), "zzz", num_clients=4)
    assert "did you mean" not in str(far.value)  # nothing close: no guess
    # the run config's own check says it once, not twice (the registry's error has it already)
    try:
        with_availability(NoGrid(), "bernouli:p=0.5", num_clients=4)
    except ScheduleError as err:
        text = str(key_error("availability", "bernouli:p=0.5", err, ["bernoulli"]))
    assert text.count("did you mean 'bernoulli'") == 1 and text.startswith("run config 'availability'")


def test_the_launcher_checks_the_apps_schedule_before_any_process_starts(capfd, monkeypatch):
    import deploy.launch as launch
    from deploy.cli import main

    monkeypatch.setattr(launch, "ProcessSite", NoGrid)  # building the site would be a process started
    code = main(["launch", "--app", "examples/advanced-pytorch-flchurn", "--num-nodes", "4", "--churn",
                 "--availability", "bernouli:p=0.5"])
    captured = capfd.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == 2 and "--availability = 'bernouli:p=0.5'" in out and "did you mean 'bernoulli'?" in out


def train_message(config: dict) -> Message:
    return Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=7, message_type=MessageType.TRAIN)


def test_the_churn_line_gives_flchurns_rules_the_partition_id_and_leaves_flowers_replies_alone():
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 3}, state=RecordDict(), run_config={})

    def train(msg, ctx):
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    ours = availability_mod(train_message({"client-rule": "plain", "server-round": 1}), context, train)
    assert ours.content["metrics"]["client-id"] == 3  # fedau & co. key their state by the partition
    flowers = availability_mod(train_message({"server-round": 1}), context, train)  # Flower's FedAvg
    assert "client-id" not in flowers.content["metrics"]
    gated = Context(run_id=1, node_id=7, node_config={"partition-id": 3}, state=RecordDict(),
                    run_config={"availability-gate": "clinet"})
    with pytest.raises(ValueError, match=r"'clinet': expected one of .* \(did you mean 'client'\?\)"):
        availability_mod(train_message({"server-round": 1}), gated, train)


def test_the_client_id_warning_points_to_the_churn_line_not_fedawes(caplog):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        ClientBinding().row(node=11, num_clients=4, rows={}, rule="fedau", others_report=False)
    (line,) = [r.getMessage() for r in caplog.records if "client-id" in r.getMessage()]
    assert line.startswith("fedau: replies carry no 'client-id'") and "availability_mod" in line
    assert "client_rule_mod" not in line
