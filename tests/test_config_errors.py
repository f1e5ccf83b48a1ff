"""Every user mistake fails before training with a message naming the fix, and leaves no run folder."""

import logging

import pytest
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from client_app.app import app as client_app
from experiments.inprocess import InProcessGrid, default_run_config, run_inprocess
from runconfig import ConfigError
from server_app.app import FAILED, main
from server_app.config import RunConfig
from server_app.experiment import run
from server_app.network import NodesMissing
from server_app.setup import prepare, strategy_spec
from strategies.protocol import IDENTITY_QUERY
from workloads.data import DatasetError

SMALL = {"num-clients": 4, "num-server-rounds": 2, "local-steps": "steps:n=2", "progress": False,
         "availability": "always", "checkpoint-every": 0}


def small(tmp_path, **over):
    return {**default_run_config(), **SMALL, "results-dir": str(tmp_path / "results"), **over}


def no_run_folder(tmp_path):
    results = tmp_path / "results"
    return not results.exists() or not any(results.iterdir())


@pytest.mark.parametrize(("key", "closest"), [("num-round", "num-server-rounds"), ("data_dir", "data-dir"),
                                              ("strategyy", "strategy"), ("lr-sched", "lr-schedule")])
def test_an_unknown_key_names_itself_and_the_closest_known_key(tmp_path, key, closest):
    with pytest.raises(ConfigError) as err:
        run_inprocess(small(tmp_path, **{key: 5}))
    assert f"'{key}'" in str(err.value) and f"did you mean '{closest}'" in str(err.value)
    assert no_run_folder(tmp_path)


def test_an_unknown_key_with_no_close_match_still_points_at_the_list(tmp_path):
    with pytest.raises(ConfigError, match=r"'xyz'; every key is listed in \[tool.flwr.app.config\]"):
        RunConfig.from_run_config(small(tmp_path, xyz=1))


def test_missing_mnist_files_name_the_run_config_keys_not_python_arguments(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(DatasetError) as err:
        run_inprocess(small(tmp_path, dataset="mnist", **{"data-dir": str(data)}))
    message = str(err.value)
    assert "data-dir" in message and "download=true" in message and str(data) in message
    assert "data_dir" not in message and "download=True" not in message
    assert no_run_folder(tmp_path)


def test_mnist_without_a_data_dir_says_the_key_is_empty(tmp_path):
    with pytest.raises(DatasetError, match="data-dir is empty"):
        run_inprocess(small(tmp_path, dataset="mnist"))
    assert no_run_folder(tmp_path)


@pytest.mark.parametrize("gate", ["server", "client"])
def test_more_nodes_than_num_clients_names_both_keys_and_the_values(tmp_path, gate):
    run_config = small(tmp_path, **{"availability-gate": gate})
    grid = InProcessGrid(6, run_config)  # 6 SuperNodes, num-clients=4: ids 4 and 5 have no partition
    with pytest.raises(ConfigError) as err:
        run(grid, RunConfig.from_run_config(run_config))
    message = str(err.value)
    assert "num-clients=4" in message and "num-supernodes=4" in message and "num-clients=6" in message
    assert "[4, 5]" in message
    assert {m.metadata.message_type for m in grid.delivered} == {IDENTITY_QUERY}  # nothing trained
    assert no_run_folder(tmp_path)


def test_fewer_nodes_than_num_clients_names_the_fix_and_leaves_no_folder(tmp_path):
    run_config = small(tmp_path, **{"wait-for-nodes": 0.2})
    with pytest.raises(NodesMissing, match=r"num-clients.*num-supernodes=4"):
        run(InProcessGrid(3, run_config), RunConfig.from_run_config(run_config))
    assert no_run_folder(tmp_path)


def test_a_run_that_dies_in_round_1_leaves_no_half_made_folder(tmp_path):
    crashing = ClientApp()

    @crashing.train()
    def boom(msg, context):
        raise RuntimeError("client crashed")

    crashing.query("identity")(client_app)
    with pytest.raises(RuntimeError, match="client crashed"):
        run_inprocess(small(tmp_path), client_app=crashing)
    assert no_run_folder(tmp_path)


def test_a_run_that_dies_later_keeps_its_rounds(tmp_path):
    crashing = ClientApp()

    @crashing.train()
    def boom_in_round_2(msg, context):
        if int(msg.content["config"]["server-round"]) == 2:
            raise RuntimeError("client crashed")
        return client_app(msg, context)

    crashing.query("identity")(client_app)
    with pytest.raises(RuntimeError):
        run_inprocess(small(tmp_path, **{"run-name": "r"}), client_app=crashing)
    assert (tmp_path / "results" / "r" / "metrics.jsonl").read_text().count("\n") == 1


def test_the_serverapp_logs_one_paragraph_and_still_fails(tmp_path, caplog):
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=small(tmp_path, **{"num-round": 5}))
    with caplog.at_level(logging.ERROR, logger="flwr"), pytest.raises(ConfigError):
        main(InProcessGrid(4, {}), context)  # re-raised: Flower marks the run finished:failed
    lines = [r.getMessage() for r in caplog.records if FAILED in r.getMessage()]
    assert len(lines) == 1
    assert "ConfigError: unknown run config key(s) 'num-round' (did you mean 'num-server-rounds'?)" in lines[0]


@pytest.mark.parametrize(("override", "match"), [
    ({"weighting": "size"}, r"weighting.*'auto'"),
    ({"max-update-norm": -1.0}, "max-update-norm"),
    ({"max-norm-ratio": -2.0}, "max-norm-ratio"),
    ({"max-norm-ratio": 0.5}, r"max-norm-ratio.*> 1"),
    ({"max-update-norm": "big"}, "expected float"),
])
def test_bad_strategy_options_are_config_errors(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_run_config(small(tmp_path, **override))


def test_zero_norm_limits_mean_the_rules_own_defaults(tmp_path):
    default = RunConfig.from_run_config(small(tmp_path, strategy="mifa"))
    assert strategy_spec(default.server) == "mifa"
    strict = RunConfig.from_run_config(small(tmp_path, strategy="mifa:wait-for-all=true",
                                             **{"max-update-norm": 50.0, "max-norm-ratio": 4.0}))
    assert strategy_spec(strict.server) == "mifa:wait-for-all=True,max-update-norm=50.0,max-norm-ratio=4.0"
    strategy = prepare(strict).strategy
    assert (strategy.max_update_norm, strategy.max_norm_ratio) == (50.0, 4.0)


def test_a_norm_limit_set_in_the_spec_and_the_run_config_must_agree(tmp_path):
    cfg = RunConfig.from_run_config(small(tmp_path, strategy="mifa:max-update-norm=10",
                                          **{"max-update-norm": 50.0}))
    with pytest.raises(ConfigError, match="max-update-norm.*set it in one place"):
        prepare(cfg)


SPEC_KEYS = [  # every run-config key that names an object by a spec: a misspelt name, and its closest
    ("availability", "sinee:gamma=0.3", "sine"),
    ("partition", "dirichlett:alpha=0.1", "dirichlet"),
    ("strategy", "fedaw", "fedawe"),
    ("solver", "momentun", "momentum"),
    ("lr-schedule", "cosinee:rounds=5", "cosine"),
    ("local-steps", "epoch:min=2", "epochs"),
    ("model", "mpl", "mlp"),
    ("dataset", "digitz", "digits"),
    ("evaluation", "per-grop", "per-group"),  # an installed entry point's name (examples/flchurn-myext)
]


@pytest.mark.parametrize(("key", "value", "closest"), SPEC_KEYS, ids=[k for k, _, _ in SPEC_KEYS])
def test_every_spec_key_exits_2_naming_the_key_and_the_closest_name(tmp_path, monkeypatch, capsys, key, value, closest):
    from extension_fixtures import use_myext

    from experiments import once

    use_myext(monkeypatch, tmp_path)
    args = ["num-clients=4", "num-server-rounds=1", "local-steps=steps:n=1", f"results-dir={tmp_path / 'results'}",
            f"{key}={value}", "--quiet"]
    assert once.main(args) == 2
    err = capsys.readouterr().err
    assert f"run config '{key}' = {value!r}" in err and f"did you mean '{closest}'?" in err
    assert no_run_folder(tmp_path)


@pytest.mark.parametrize("key", [k for k, _, _ in SPEC_KEYS if k not in ("local-steps",)])
def test_a_module_attr_that_does_not_import_says_so_under_its_key(tmp_path, key):
    """Not "bad name": ``tzfl.local:thing`` is read as a module:attr reference, and the error says
    the module does not import (local-steps takes no objects of the user's)."""
    with pytest.raises(ConfigError) as err:
        run_inprocess(small(tmp_path, **{key: "tzfl.local:thing"}))
    message = str(err.value)
    assert message.startswith(f"run config '{key}' = 'tzfl.local:thing'") and "bad name" not in message
    assert "cannot import module 'tzfl.local'" in message
    assert no_run_folder(tmp_path)


def test_missing_data_files_exit_2(tmp_path, capsys):
    from experiments import once

    assert once.main(["dataset=mnist", f"data-dir={tmp_path}", "--quiet"]) == 2
    assert "data-dir" in capsys.readouterr().err
