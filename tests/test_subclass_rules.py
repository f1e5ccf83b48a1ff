"""Rules as classes a user subclasses: ``class Mine(Rule)`` with Flower's overrides calling
``super()``, built from the rule's spec parameters, under the user's own ``start`` loop."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp.strategy import Result
from test_dropin import NUM_NODES, Tiny, tiny_app

from experiments.inprocess import InProcessGrid
from strategies import build_strategy, rule_spec


def own_loop(strategy, grid, initial_arrays, num_rounds, train_config, evaluate_fn):
    """A user's round loop (Flower's advanced-pytorch copies Strategy.start): no super().start."""
    result, arrays = Result(), initial_arrays
    if evaluate_fn:
        result.evaluate_metrics_serverapp[0] = evaluate_fn(0, initial_arrays)
    for rnd in range(1, num_rounds + 1):
        replies = grid.send_and_receive(strategy.configure_train(rnd, arrays, train_config, grid), timeout=60)
        new, metrics = strategy.aggregate_train(rnd, replies)
        if new is not None:
            result.arrays = arrays = new
        result.train_metrics_clientapp[rnd] = metrics
        strategy.aggregate_evaluate(rnd, grid.send_and_receive(
            strategy.configure_evaluate(rnd, arrays, ConfigRecord(), grid), timeout=60))
        if evaluate_fn:
            result.evaluate_metrics_serverapp[rnd] = evaluate_fn(rnd, arrays)
    return result


def mine(spec: str):
    """``class Mine(Rule)`` as a user writes it: a learning-rate schedule in configure_train, an
    extra metric in aggregate_train, its own start loop; every override calls super()."""
    Rule, params = rule_spec(spec)

    class Mine(Rule):
        def __init__(self, *, lr_decay: float = 0.5, **kwargs):
            super().__init__(**kwargs)
            self.lr_decay = lr_decay
            self.lrs: list[float] = []

        def configure_train(self, server_round, arrays, config, grid):
            if server_round > 1:
                config["lr"] = config["lr"] * self.lr_decay
            self.lrs.append(config["lr"])
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            arrays, metrics = super().aggregate_train(server_round, replies)
            metrics["mine"] = server_round
            return arrays, metrics

        def start(self, grid, initial_arrays, num_rounds=3, timeout=3600.0, train_config=None,
                  evaluate_config=None, evaluate_fn=None):
            return own_loop(self, grid, initial_arrays, num_rounds, train_config, evaluate_fn)

    return Mine, params


def norm_fn(shown):
    def evaluate_fn(rnd, arrays):
        shown.setdefault(rnd, arrays)
        return MetricRecord({"norm": float(sum(np.abs(a).sum() for a in arrays.to_numpy_ndarrays()
                                                if a.dtype.kind == "f"))})
    return evaluate_fn


def run(strategy, rounds=3, evaluate_fn=None):
    torch.manual_seed(0)
    extra = {} if evaluate_fn is None else {"evaluate_fn": evaluate_fn}
    return strategy.start(grid=InProcessGrid(NUM_NODES, {}, client_app=tiny_app()),
                          initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=rounds, timeout=60,
                          train_config=ConfigRecord({"lr": 0.5}), **extra)


@pytest.mark.parametrize("spec", ["fedexp:max-step=3.0", "fedau:cutoff=2", "fedawe:clip=0.5"])
def test_a_subclassed_rule_with_super_overrides_equals_the_rule_under_flowers_start(spec):
    """Mine's own loop and overrides (lr 0.5 constant when lr_decay=1) give the rule's numbers under
    Flower's start, evaluate_fn shown the same scored models (FedExP's mean of two iterates,
    FedAWE's x-bar as norm-xbar)."""
    Mine, params = mine(spec)
    assert params and all("-" not in k for k in params)  # the rule's spec parameters as keywords
    strategy = Mine(**params, lr_decay=1.0, num_clients=NUM_NODES)
    assert isinstance(strategy, rule_spec(spec)[0]) and strategy.name == spec.split(":")[0]
    ours, theirs = {}, {}
    result = run(strategy, evaluate_fn=norm_fn(ours))
    reference = run(build_strategy(spec, num_clients=NUM_NODES), evaluate_fn=norm_fn(theirs))
    assert strategy.lrs == [0.5, 0.5, 0.5] and [result.train_metrics_clientapp[r]["mine"] for r in (1, 2, 3)] == [1, 2, 3]
    for rnd in (1, 2, 3):
        assert dict(result.evaluate_metrics_serverapp[rnd]) == pytest.approx(dict(reference.evaluate_metrics_serverapp[rnd]))
    for a, b in zip(result.arrays.to_numpy_ndarrays(), reference.arrays.to_numpy_ndarrays(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    if spec.startswith("fedexp"):  # scored on the mean of the last two iterates, not x^{t+1}
        assert not np.allclose(ours[3]["fc.weight"].numpy(), result.arrays["fc.weight"].numpy())
    if spec.startswith("fedawe"):
        assert set(result.evaluate_metrics_serverapp[3]) == {"norm", "norm-xbar"}


def test_the_overrides_take_effect():
    """The lr schedule of Mine.configure_train reaches the clients (read at delivery: Flower's
    loops reuse one ConfigRecord), and super().configure_train still addresses every node."""
    class Seen(InProcessGrid):
        lrs: list = []

        def deliver(self, msg):
            if msg.metadata.message_type == "train":
                self.lrs.append((int(msg.content["config"]["server-round"]), msg.content["config"]["lr"]))
            return super().deliver(msg)

    Mine, params = mine("fedau")
    strategy = Mine(**params, lr_decay=0.5, num_clients=NUM_NODES)
    grid = Seen(NUM_NODES, {}, client_app=tiny_app())
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=3,
                   train_config=ConfigRecord({"lr": 0.5}))
    assert strategy.lrs == [0.5, 0.25, 0.125]
    assert sorted(grid.lrs) == sorted((r, 0.5 / 2 ** (r - 1)) for r in (1, 2, 3) for _ in range(NUM_NODES))


def test_a_loop_that_cannot_be_wrapped_says_so_loudly(caplog):
    """A start without an evaluate_fn parameter (the loop calls its own): FedExP warns, once, that
    evaluate_fn sees x^{t+1}; a rule scored on x^{t+1} says nothing."""
    def subclass(spec):
        Rule, params = rule_spec(spec)
        shown = {}

        class Fixed(Rule):
            def start(self, grid, initial_arrays, num_rounds=3, timeout=3600.0, train_config=None):
                return own_loop(self, grid, initial_arrays, num_rounds, train_config, norm_fn(shown))

        return Fixed(**params, num_clients=NUM_NODES)

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run(subclass("fedexp"))
    assert caplog.text.count("fedexp is scored on another model than x^{t+1}") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run(subclass("fedau"))
    assert "scored on another model" not in caplog.text


def test_rule_spec_names_bad_specs():
    with pytest.raises(ValueError, match="unknown strategy"):
        rule_spec("fedsgd")
    with pytest.raises(ValueError, match="cutof"):
        rule_spec("fedau:cutof=3")
    with pytest.raises(ValueError, match="oracle"):
        rule_spec("fedavg-known-p")


MOMENTUM = '''
import numpy as np
from dataclasses import dataclass
from strategies import FedAvgActive


class MomentumAvg(FedAvgActive):
    """Server momentum on FedAvg's step (a user's rule, no name declared)."""

    @dataclass
    class State:
        velocity: object = None

    def __init__(self, *, beta: float = 0.9, **kwargs):
        super().__init__(**kwargs)
        self.beta, self.velocity = beta, None

    def aggregate(self, t, x, reports):
        moved, metrics = super().aggregate(t, x, reports)
        step = moved - x
        self.velocity = step if self.velocity is None else self.beta * self.velocity + step
        return x + self.velocity.astype(np.float32), metrics


class Declared(FedAvgActive):
    name = "my-declared"


class Clash(FedAvgActive):
    name = "mifa"
'''


@pytest.fixture
def user_rules(tmp_path, monkeypatch):
    (tmp_path / "userrules.py").write_text(MOMENTUM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


def test_a_users_rule_subclass_runs_under_its_own_name(user_rules, tmp_path, caplog):
    """Errors, the strategy's name (logs), its checkpoint and the results folder say MomentumAvg's
    name, never its parent's (fedavg-active); a declared name wins; a built-in's name is refused."""
    import json

    from availability import SpecError
    from experiments.inprocess import run_inprocess
    from runconfig.extensions import ExtensionError
    from server_app import checkpoint

    with pytest.raises(SpecError, match=r"strategy 'momentum-avg': unknown parameter\(s\) \['bta'\]") as err:
        build_strategy("userrules:MomentumAvg:bta=0.5", num_clients=4)
    assert "fedavg-active" not in str(err.value)
    rule = build_strategy("userrules:MomentumAvg:beta=0.5", num_clients=4)
    assert rule.name == "momentum-avg" and rule.state_dict()["rule"] == "momentum-avg"
    assert build_strategy("userrules:Declared", num_clients=4).name == "my-declared"
    with pytest.raises(ExtensionError, match="the name of the built-in rule MIFA"):
        build_strategy("userrules:Clash", num_clients=4)
    assert build_strategy("fedavg-active", num_clients=4).name == "fedavg-active"  # the parent keeps its own

    small = {"num-clients": 4, "num-server-rounds": 2, "local-steps": "steps:n=1", "model": "logreg",
             "availability": "always", "progress": False, "checkpoint-every": 2, "results-dir": str(tmp_path / "r")}
    with caplog.at_level(logging.INFO):
        run = run_inprocess({**small, "strategy": "userrules:MomentumAvg:beta=0.5"})
    assert "-MomentumAvg-" in run.name and ":" not in run.name
    saved = checkpoint.load(checkpoint.path_of(run, 2))
    assert saved["strategy"]["rule"] == "momentum-avg"
    assert json.loads((run / "config.json").read_text())["strategy"] == "userrules:MomentumAvg:beta=0.5"
    named = [r.getMessage() for r in caplog.records if "momentum-avg" in r.getMessage()]
    assert named and not any("fedavg-active" in r.getMessage() for r in caplog.records)
