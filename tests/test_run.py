"""The ServerApp round loop against the real ClientApp, in process (no Ray): end to end."""

import dataclasses
import json
import shutil
import tomllib

import numpy as np
import pytest
import torch
from conftest import ROOT
from flwr.app import ArrayRecord, Message
from flwr.clientapp import ClientApp

from client_app.app import app as client_app
from experiments.inprocess import InProcessGrid, default_run_config, run_inprocess
from runconfig import AvailabilityConfig, ConfigError, WorkloadConfig
from server_app.config import RunConfig, ServerConfig
from server_app.experiment import run
from server_app.network import NodesMissing
from server_app.results import read_matrix, read_metrics
from strategies import STRATEGIES, FedAvgActive
from workloads.data import DatasetError

SMALL = {"num-clients": 8, "num-server-rounds": 6, "local-steps": "steps:n=3", "progress": False,
         "availability": "staircase:period=4,low=0.3", "checkpoint-every": 3}
TIMES = {"round-time", "wall-time"}


def small(tmp_path, **over):
    return {**SMALL, "results-dir": str(tmp_path), **over}


def rows_without_times(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMES} for r in read_metrics(run_dir)]


def final_model(run_dir):
    return torch.load(run_dir / "final_model.pt", weights_only=True)


def test_pyproject_defaults_are_the_config_defaults():
    """One place for defaults: an empty run config (run_simulation) runs the main job."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    from_code = RunConfig(ServerConfig(), WorkloadConfig(), AvailabilityConfig()).to_dict()
    assert declared == from_code


def test_same_config_twice_gives_identical_rounds_and_model(tmp_path):
    a = run_inprocess(small(tmp_path, **{"run-name": "a"}))
    b = run_inprocess(small(tmp_path, **{"run-name": "b"}))
    rows = rows_without_times(a)
    assert len(rows) == 6 and rows == rows_without_times(b)
    assert all(0 <= r["test-accuracy"] <= 1 for r in rows)
    for k, v in final_model(a).items():
        assert torch.equal(v, final_model(b)[k])
    seeds = (a / "config.json").read_text()
    assert '"data-seed": 0' in seeds and '"schedule-seed": 0' in seeds and '"train-seed": 0' in seeds


def test_training_seed_changes_the_numbers_but_not_participation(tmp_path):
    a = run_inprocess(small(tmp_path, **{"run-name": "a"}))
    b = run_inprocess(small(tmp_path, **{"run-name": "b", "train-seed": 1}))
    assert rows_without_times(a) != rows_without_times(b)
    np.testing.assert_array_equal(read_matrix(a / "participation.csv"), read_matrix(b / "participation.csv"))


@pytest.mark.parametrize("gate", ["server", "client"])
def test_realised_participation_equals_the_schedule(tmp_path, gate):
    run_dir = run_inprocess(small(tmp_path, **{"availability-gate": gate, "num-server-rounds": 8}))
    realised = read_matrix(run_dir / "participation.csv")
    scheduled = read_matrix(run_dir / "availability.csv")
    assert realised.shape == (8, 8)
    np.testing.assert_array_equal(realised, scheduled)
    assert 0 < realised.mean() < 1  # the schedule really takes clients away


def test_client_gate_and_server_gate_give_the_same_run(tmp_path):
    a = run_inprocess(small(tmp_path, **{"run-name": "a", "availability-gate": "server"}))
    b = run_inprocess(small(tmp_path, **{"run-name": "b", "availability-gate": "client"}))
    strip = ("unavailable-nodes", "num-unavailable")  # server gate: offline nodes are not listed, so not addressed
    assert [{k: v for k, v in r.items() if k not in strip} for r in rows_without_times(a)] == [
        {k: v for k, v in r.items() if k not in strip} for r in rows_without_times(b)]


def test_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path):
    full = run_inprocess(small(tmp_path, **{"run-name": "full", "strategy": "fedavg-known-p"}))
    copy = tmp_path / "resumed"
    shutil.copytree(full, copy)
    (copy / "final_model.pt").unlink()
    resumed = run_inprocess(small(tmp_path, **{"strategy": "fedavg-known-p",
                                               "resume-from": str(copy / "checkpoints" / "round-0003.pt")}))
    assert resumed == copy
    assert rows_without_times(resumed) == rows_without_times(full)
    for k, v in final_model(full).items():
        assert torch.equal(v, final_model(resumed)[k])


def test_resume_refuses_a_checkpoint_made_with_other_settings(tmp_path):
    full = run_inprocess(small(tmp_path, **{"run-name": "full"}))
    with pytest.raises(ConfigError, match="lr"):
        run_inprocess(small(tmp_path, lr=0.5, **{"resume-from": str(full / "checkpoints" / "round-0003.pt")}))


def test_latest_checkpoint_skips_a_truncated_one(tmp_path):
    from server_app import checkpoint

    full = run_inprocess(small(tmp_path, **{"run-name": "full", "num-server-rounds": 6}))
    assert checkpoint.latest(full) == full / "checkpoints" / "round-0006.pt"
    newest = full / "checkpoints" / "round-0006.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # a crash mid-copy
    assert checkpoint.latest(full) == full / "checkpoints" / "round-0003.pt"
    assert checkpoint.load(checkpoint.latest(full))["round"] == 3
    with pytest.raises(ConfigError, match="no readable checkpoint"):
        checkpoint.latest(tmp_path)


def test_a_malformed_reply_is_rejected_and_the_run_goes_on(tmp_path):
    poisoned = ClientApp()

    def nan_for_client_0(msg: Message, context) -> Message:
        out = client_app(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            first = next(iter(out.content["arrays"].keys()))
            bad = out.content["arrays"].to_numpy_ndarrays()
            bad[0][...] = np.nan
            from strategies import named_arrays
            out.content["arrays"] = named_arrays(dict(zip(out.content["arrays"].keys(), bad, strict=True)))
            assert first in out.content["arrays"]
        return out

    poisoned.train()(nan_for_client_0)
    poisoned.query("identity")(client_app)
    run_dir = run_inprocess(small(tmp_path, availability="always"), client_app=poisoned)
    rows = read_metrics(run_dir)
    assert all(0 not in r["participants"] and len(r["participants"]) == 7 for r in rows)
    assert all(len(r["rejected"]) == 1 and "NaN" in r["rejected"][0][1] for r in rows)
    assert np.isfinite(rows[-1]["test-loss"])


def test_missing_replies_are_unavailable_and_rounds_never_wait_for_them(tmp_path):
    down = lambda rnd, client: client % 2 == 1  # noqa: E731  odd clients never answer
    run_dir = run_inprocess(small(tmp_path, availability="always"), down=down)
    for r in read_metrics(run_dir):
        assert r["participants"] == [0, 2, 4, 6] and r["unavailable-nodes"] == 4


def test_too_few_nodes_fails_with_a_message_naming_the_fix(tmp_path):
    cfg = RunConfig.from_run_config({**default_run_config(), **small(tmp_path, **{"wait-for-nodes": 0.2})})
    grid = InProcessGrid(3, {})
    with pytest.raises(NodesMissing, match="num-supernodes=8"):
        run(grid, cfg)


@pytest.mark.parametrize(
    ("override", "error", "match"),
    [
        ({"availability": "sine:gamma=2"}, ConfigError, "'availability' = 'sine:gamma=2': .*gamma"),
        ({"availability": "sine:gamma"}, ConfigError, "'availability'.*key=value"),
        ({"availability": "weekly"}, ConfigError, "'availability'.*weekly"),
        ({"partition": "dirichlet:alpha=-1"}, ConfigError, "'partition'.*alpha"),
        ({"strategy": "fedsgd"}, ConfigError, "'strategy'.*unknown strategy 'fedsgd'"),
        ({"dataset": "imagenet"}, ConfigError, "imagenet"),
        ({"model": "resnet"}, ConfigError, "resnet"),
        ({"lr": -0.1}, ConfigError, "'lr'"),
        ({"num-clients": 0}, ConfigError, "num-clients"),
        ({"availability-gate": "both"}, ConfigError, "availability-gate"),
        ({"num-server-rounds": 0}, ConfigError, "num-server-rounds"),
        ({"lr": "fast"}, ConfigError, "expected float"),
        ({"num-rounds": 5}, ConfigError, "unknown run config key"),
        ({"local-steps": "epochs:min=5,max=2"}, ConfigError, "'local-steps'.*min"),
        ({"device": "cuda:7"}, ConfigError, "device"),
    ],
)
def test_bad_input_fails_before_training_with_a_clear_error(tmp_path, override, error, match):
    run_config = {**default_run_config(), **small(tmp_path), **override}
    grid = InProcessGrid(8, run_config)
    with pytest.raises(error, match=match):
        run(grid, RunConfig.from_run_config(run_config))
    assert grid.delivered == []  # nothing was sent, nothing trained
    assert not any(tmp_path.iterdir())  # and no half-made results folder


def test_missing_data_files_name_the_files_and_the_place(tmp_path):
    run_config = {**default_run_config(), **small(tmp_path), "dataset": "mnist", "data-dir": str(tmp_path)}
    grid = InProcessGrid(8, run_config)
    with pytest.raises(DatasetError) as info:
        run(grid, RunConfig.from_run_config(run_config))
    message = str(info.value)
    assert "train-images-idx3-ubyte" in message and str(tmp_path) in message
    assert grid.delivered == []


def test_dataclass_fields_are_all_documented_in_pyproject():
    keys = set(default_run_config())
    for cls in (ServerConfig, WorkloadConfig, AvailabilityConfig):
        for f in dataclasses.fields(cls):
            assert f.name.replace("_", "-") in keys


class WithZeroModel(FedAvgActive):
    """FedAvg that also asks for an all-zero model to be evaluated (as FedAWE asks for its x̄)."""

    name = "with-zero-model"

    def extra_evaluation_arrays(self, arrays):
        return {"zero": ArrayRecord({k: torch.zeros_like(v) for k, v in arrays.to_torch_state_dict().items()})}


def test_extra_models_are_evaluated_whenever_the_global_model_is(tmp_path, monkeypatch):
    monkeypatch.setitem(STRATEGIES, "with-zero-model", WithZeroModel)
    run_dir = run_inprocess(small(tmp_path, strategy="with-zero-model", **{"eval-every": 2}))
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows if "test-accuracy-zero" in r] == [2, 4, 6]
    assert [r["round"] for r in rows if "test-accuracy" in r] == [2, 4, 6]
    for r in (r for r in rows if "test-loss-zero" in r):  # zero weights: uniform over 10 classes
        assert r["test-loss-zero"] == pytest.approx(np.log(10), rel=1e-6)
        assert r["test-loss"] != pytest.approx(r["test-loss-zero"])


@pytest.mark.parametrize(("strategy", "weighting", "used"), [
    ("fedavg-active", "auto", "num-examples"), ("fedau", "auto", "equal"), ("fednova", "equal", "equal")])
def test_config_json_records_the_weighting_the_rule_used(tmp_path, strategy, weighting, used):
    run_dir = run_inprocess(small(tmp_path, strategy=strategy, weighting=weighting, **{"num-server-rounds": 1}))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["weighting"] == weighting and config["weighting-used"] == used
