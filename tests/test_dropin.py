"""The strategies inside someone else's Flower app, tested as Flower tests its own strategies.

Flower's style (``flwr/serverapp/strategy/*_test.py``): replies built by a ``create_mock_reply``
helper, state set directly (``strategy.current_arrays = ...``), then ``aggregate_train``. And the
whole loop under Flower's own ``Strategy.start`` with a plain ClientApp (a model holding
BatchNorm, an embedding and integer buffers) that uses only ``client_app.dropin``.
"""

import uuid
from unittest.mock import Mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Strategy
from rich.console import Console
from torch import nn

from client_app.dropin import adopt, client_rule_mod, correct_gradients
from experiments.inprocess import NODE_ID_BASE, InProcessGrid, default_run_config, run_inprocess
from server_app.config import RunConfig
from server_app.setup import prepare
from strategies import ORACLES, STRATEGIES, StrategyFailure, build_strategy

NUM_NODES = 4


# ------------------------------------------------------------------------------ helpers
def create_mock_reply(arrays: ArrayRecord, num_examples: float, **metrics) -> Message:
    """Flower's helper (``strategy_utils_test.create_mock_reply``), plus optional metrics."""
    message = Mock(spec=Message)
    message.content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples, **metrics})}
    )
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


class Tiny(nn.Module):
    """Embedding -> BatchNorm -> Linear, an int64 index table and a 0-d int32 counter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("vocab", torch.arange(12, dtype=torch.int64).flip(0))  # must stay as is
        self.register_buffer("seen", torch.tensor(0, dtype=torch.int32))  # 0-d integer counter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return self.fc(self.bn(self.emb(self.vocab[tokens])))


def data(pid: int, rnd: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * pid + rnd)
    x = torch.randint(12, (16,), generator=g)
    return x, x % 3


def tiny_app(a_norm: bool = True, dropin: bool = True, adopt_handler: bool = True,
             eval_loss: bool = True, mods: tuple = ()) -> ClientApp:
    """Flower's template ClientApp for ``Tiny``, with the lines of client_app.dropin
    (``dropin``: the mod and ``correct_gradients``, ``adopt_handler``: the broadcast handler) after
    ``mods``."""
    app = ClientApp(mods=[*mods, *([client_rule_mod] if dropin else [])])
    if adopt_handler:
        app.train("adopt")(adopt)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Tiny()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        if dropin:
            correct_gradients(model, context)  # SCAFFOLD's drift correction (a no-op for the others)
        pid = int(context.node_config.get("partition-id", context.node_id % 97))
        x, y = data(pid, int(msg.content["config"]["server-round"]))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model.train()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        metrics = {"train_loss": loss.item(), "num-examples": 16 + 8 * pid}
        if a_norm:  # FedNova's ‖a_i‖_1 and τ_i (one plain SGD step: both 1)
            metrics["a-norm"] = 1.0
            metrics["num-steps"] = 1
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = Tiny()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.eval()
        x, y = data(int(context.node_config.get("partition-id", 0)), 0)
        with torch.no_grad():
            out = model(x)
        metrics = {"eval_acc": float((out.argmax(1) == y).float().mean()), "num-examples": 16}
        if eval_loss:
            metrics["eval_loss"] = float(F.cross_entropy(out, y))
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


class FlowerGrid(InProcessGrid):
    """The in-process grid, with a ClientApp's exception turned into an error reply, as Flower's
    engines do (code 2, CLIENT_APP_RAISED_EXCEPTION, the exception in the reason)."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.delivered.append(msg)
            try:
                replies.append(self.app(msg, self.contexts[msg.metadata.dst_node_id]))
            except Exception as exc:  # noqa: BLE001  (what the engines do)
                replies.append(Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        return replies


def strategy_for(spec: str, **kwargs):
    name = spec.split(":")[0]
    if name in ORACLES:
        kwargs["probabilities"] = lambda t: np.ones(NUM_NODES)
    return build_strategy(spec, **kwargs)


def run_start(strategy, rounds=3, app=None, grid=None, evaluate_fn=None):
    """Flower's own Strategy.start (not the project's loop, not an override) on an in-process grid."""
    torch.manual_seed(0)
    initial = ArrayRecord(Tiny().state_dict())
    grid = grid or FlowerGrid(NUM_NODES, {}, client_app=app or tiny_app())
    result = Strategy.start(strategy, grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=60,
                            train_config=ConfigRecord({"lr": 0.5}), evaluate_fn=evaluate_fn)
    return initial, result


# ---------------------------------------------------------- every rule, every array shape
RULES = sorted(set(STRATEGIES) - {"cluster-fedvarp"}) + ["cluster-fedvarp:clusters=2", "pow-d:d=4,m=2"]
RULES.remove("pow-d")


@pytest.mark.parametrize("spec", RULES)
def test_batchnorm_embedding_and_integer_buffers_survive_every_rule(spec):
    strategy = strategy_for(spec, num_clients=NUM_NODES)
    initial, result = run_start(strategy)
    before, after = initial.to_torch_state_dict(), result.arrays.to_torch_state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].shape == value.shape and after[key].dtype == value.dtype, key
    assert after["bn.num_batches_tracked"].shape == ()  # 0-d stays 0-d (was (1,): every reply rejected)
    Tiny().load_state_dict(after)  # strict
    assert torch.equal(after["vocab"], before["vocab"])  # the same in every reply: carried unchanged
    for key in ("emb.weight", "bn.weight", "fc.weight"):
        assert not torch.equal(after[key], before[key]), key
    assert not torch.equal(after["bn.running_mean"], before["bn.running_mean"])
    trained = 2 if spec.startswith("pow-d") else NUM_NODES
    for rnd, metrics in result.train_metrics_clientapp.items():
        assert metrics["num-rejected"] == 0, rnd
        assert metrics["num-participants"] == trained, rnd
    # the integer counters: every client counts one batch per round, so the mean count is the round
    assert int(after["bn.num_batches_tracked"]) == 3
    assert int(after["seen"]) == 3


def test_integer_arrays_can_be_kept_as_the_global_model_holds_them():
    strategy = build_strategy("fedavg-active", integer_arrays="keep")
    initial, result = run_start(strategy, rounds=2)
    assert int(result.arrays["bn.num_batches_tracked"].numpy()) == 0
    with pytest.raises(ValueError, match="integer_arrays"):
        build_strategy("fedavg-active", integer_arrays="sum")


# ------------------------------------------------------------- Flower's own test style
def test_flowers_create_mock_reply_and_current_arrays_work():
    """Flower's FedAvgM test, scalar weights included, against fedavg-active."""
    strategy = build_strategy("fedavg-active")
    strategy.current_arrays = ArrayRecord([np.array(0.0), np.zeros((2, 3), np.float32)])
    replies = [
        create_mock_reply(ArrayRecord([np.array(1.0), np.ones((2, 3), np.float32)]), num_examples=1),
        create_mock_reply(ArrayRecord([np.array(3.0), 3 * np.ones((2, 3), np.float32)]), num_examples=2),
    ]
    actual, metrics = strategy.aggregate_train(1, replies)
    scalar, matrix = actual.to_numpy_ndarrays()
    assert scalar.shape == ()
    np.testing.assert_allclose(scalar, 7.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(matrix, np.full((2, 3), 7.0 / 3.0), rtol=1e-6)
    assert metrics["num-participants"] == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedavg_active_auto_equals_flowers_fedavg(seed):
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (), (5,)]
    initial = ArrayRecord([rng.normal(size=s).astype(np.float32) for s in shapes])
    replies = [create_mock_reply(ArrayRecord([rng.normal(size=s).astype(np.float32) for s in shapes]),
                                 num_examples=int(rng.integers(1, 500)), train_loss=float(rng.random()))
               for _ in range(5)]
    flower, _ = FedAvg().aggregate_train(1, replies)
    ours = build_strategy("fedavg-active")  # weighting="auto": FedAvg's paper weights, n_i / n
    assert ours.weighting == "num-examples"
    ours.current_arrays = initial
    mine, metrics = ours.aggregate_train(1, replies)
    for a, b in zip(mine.to_numpy_ndarrays(), flower.to_numpy_ndarrays(), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "train-loss" in metrics  # Flower's train_loss is read


# ---------------------------------------------------------------- Flower's arguments
def test_flowers_fedavg_arguments_are_accepted_with_flowers_meaning():
    seen = {}

    def train_aggr(contents, key):
        seen["train"] = (len(contents), key)
        return MetricRecord({"custom": 1.0})

    def eval_aggr(contents, key):
        seen["evaluate"] = (len(contents), key)
        return MetricRecord({"custom-eval": 2.0})

    strategy = build_strategy(
        "fedavg-active", fraction_train=0.5, fraction_evaluate=0.25, min_train_nodes=1,
        min_evaluate_nodes=1, min_available_nodes=2, weighted_by_key="num-examples",
        train_metrics_aggr_fn=train_aggr, evaluate_metrics_aggr_fn=eval_aggr)
    _, result = run_start(strategy, rounds=2)
    for rnd in (1, 2):
        assert result.train_metrics_clientapp[rnd]["num-participants"] == 2  # int(4 * 0.5)
        assert result.train_metrics_clientapp[rnd]["custom"] == 1.0
        assert result.evaluate_metrics_clientapp[rnd]["custom-eval"] == 2.0
    assert seen == {"train": (2, "num-examples"), "evaluate": (1, "num-examples")}


def test_record_keys_and_weight_key_are_used():
    class Spy(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            for m in messages:
                if m.metadata.message_type == "train":
                    assert set(m.content) == {"weights", "settings"}
            return [self.reply(m) for m in messages]

        def reply(self, m):
            arrays, config = m.content["weights"], m.content["settings"]
            rnd = int(config["server-round"])
            model = [a + 1.0 for a in arrays.to_numpy_ndarrays()]
            node = m.metadata.dst_node_id - NODE_ID_BASE
            content = RecordDict({"weights": ArrayRecord(model),
                                  "metrics": MetricRecord({"n": node + 1, "train_loss": float(rnd)})})
            return Message(content, reply_to=m)

    strategy = build_strategy("fedavg-active", arrayrecord_key="weights", configrecord_key="settings",
                              weighted_by_key="n", fraction_evaluate=0.0)
    grid = Spy(NUM_NODES, {})
    initial = ArrayRecord([np.zeros(3, np.float32)])
    result = Strategy.start(strategy, grid=grid, initial_arrays=initial, num_rounds=2, timeout=10)
    np.testing.assert_allclose(result.arrays.to_numpy_ndarrays()[0], np.full(3, 2.0), rtol=1e-6)


@pytest.mark.parametrize("spec, kwargs, why", [
    ("pow-d", {"fraction_train": 0.5}, "chooses its own clients"),
    ("fedavg-known-p", {"fraction_train": 0.5}, "true participation probabilities"),
    ("full", {"fraction_train": 0.5}, "every client"),
    ("fedavg-active", {"fraction_train": 1.5}, "fraction_train"),
    ("fedavg-active", {"min_available_nodes": -1}, "min_available_nodes"),
    ("fedau", {"num_clients": 0}, "num_clients"),
    ("fedau", {"weighted_by_key": ""}, "weighted_by_key"),
    ("fedavg-active", {"proximal_mu": 0.1}, "unknown argument.*proximal_mu"),  # FedProx's, not FedAvg's
])
def test_flower_arguments_that_cannot_apply_are_refused_with_the_reason(spec, kwargs, why):
    with pytest.raises(ValueError, match=why):
        strategy_for(spec, **kwargs)


def test_min_available_nodes_never_waits_forever(caplog):
    strategy = build_strategy("fedavg-active", min_available_nodes=10, node_wait=0.3)
    _, result = run_start(strategy, rounds=1)
    assert result.train_metrics_clientapp[1]["num-participants"] == NUM_NODES
    assert "min_available_nodes=10" in caplog.text


# -------------------------------------------------------------- identities and N
def test_num_clients_comes_from_the_connected_nodes_before_any_training():
    strategy = build_strategy("fedau")
    assert strategy.num_clients is None
    _, result = run_start(strategy, rounds=2)
    assert strategy.num_clients == NUM_NODES
    assert result.train_metrics_clientapp[2]["num-participants"] == NUM_NODES


def test_num_clients_comes_from_the_run_config_when_it_has_one():
    assert build_strategy("fedau", run_config={"num-clients": 7}).num_clients == 7
    assert build_strategy("fedau", num_clients=3, run_config={"num-clients": 7}).num_clients == 3
    assert build_strategy("fedau", run_config={"lr": 0.1}).num_clients is None


def test_without_any_node_the_error_comes_before_training():
    class Empty(InProcessGrid):
        def get_node_ids(self):
            return []

    strategy = build_strategy("fedau", node_wait=0.2)
    with pytest.raises(StrategyFailure, match="num_clients"):
        run_start(strategy, rounds=1, grid=Empty(NUM_NODES, {}, client_app=tiny_app()))


def test_client_id_falls_back_to_the_partition_id_then_to_the_node():
    strategy = build_strategy("mifa", num_clients=NUM_NODES)
    run_start(strategy, rounds=2)
    assert sorted(strategy.node_of_client) == list(range(NUM_NODES))  # partition ids, via client_rule_mod
    grid = InProcessGrid(NUM_NODES, {}, client_app=tiny_app())
    for c in grid.contexts.values():
        del c.node_config["partition-id"]
    strategy = build_strategy("mifa", num_clients=NUM_NODES)
    _, result = run_start(strategy, rounds=2, grid=grid)
    assert result.train_metrics_clientapp[2]["num-participants"] == NUM_NODES
    assert sorted(strategy.node_of_client) == list(range(NUM_NODES))  # one row per node, in [0, N)


# ------------------------------------------------------------------ no silent failure
def test_a_run_whose_replies_are_all_rejected_fails_with_the_metric_to_add(caplog):
    strategy = build_strategy("fednova", max_failed_rounds=2)
    with pytest.raises(StrategyFailure, match="a-norm") as failure:
        run_start(strategy, rounds=4, app=tiny_app(a_norm=False))
    assert "2 rounds" in str(failure.value)
    # one log line per reason and round, with the count (not one per reply)
    lines = [r for r in caplog.records if "rejected" in r.getMessage() and "a-norm" in r.getMessage()]
    assert len(lines) == 2
    assert f"{NUM_NODES} replies" in lines[0].getMessage()
    assert all(r.name.startswith("flwr") for r in lines)


def test_max_failed_rounds_zero_keeps_going():
    strategy = build_strategy("fednova", max_failed_rounds=0)
    initial, result = run_start(strategy, rounds=2, app=tiny_app(a_norm=False))
    assert result.train_metrics_clientapp[2]["num-rejected"] == NUM_NODES


def test_pow_d_reads_flowers_eval_loss():
    strategy = build_strategy("pow-d:d=4,m=2")
    _, result = run_start(strategy, rounds=2)
    for rnd in (1, 2):
        metrics = result.train_metrics_clientapp[rnd]
        assert metrics["probe-replies"] == NUM_NODES
        assert len(metrics["chosen-clients"]) == 2
        assert metrics["num-participants"] == 2


def test_pow_d_without_any_probe_loss_fails_naming_the_metric():
    strategy = build_strategy("pow-d:d=4,m=2", max_failed_rounds=1)
    with pytest.raises(StrategyFailure, match="eval_loss"):
        run_start(strategy, rounds=2, app=tiny_app(eval_loss=False))


def test_aggregate_evaluate_aggregates_the_client_metrics():
    strategy = build_strategy("fedavg-active")
    replies = [create_mock_reply(ArrayRecord(), num_examples=n, eval_loss=loss, eval_acc=acc)
               for n, loss, acc in ((10, 1.0, 0.5), (30, 2.0, 0.9))]
    for r in replies:
        r.content = RecordDict({"metrics": r.content["metrics"]})
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["eval_loss"] == pytest.approx(1.75)
    assert metrics["eval_acc"] == pytest.approx(0.8)


# -------------------------------------------------------- what evaluate_fn is shown
def test_evaluate_fn_sees_the_model_the_rule_is_scored_on():
    shown = {}

    def evaluate_fn(rnd, arrays):
        shown.setdefault(rnd, []).append(arrays)
        return MetricRecord({"norm": float(sum(np.abs(a).sum() for a in arrays.to_numpy_ndarrays()
                                                if a.dtype.kind == "f"))})

    strategy = build_strategy("fedexp")
    result = strategy.start(grid=InProcessGrid(NUM_NODES, {}, client_app=tiny_app()),
                            initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=2, timeout=60,
                            evaluate_fn=evaluate_fn)
    assert not np.allclose(shown[2][0]["fc.weight"].numpy(), result.arrays["fc.weight"].numpy())

    strategy = build_strategy("fedawe", num_clients=NUM_NODES)
    shown.clear()
    result = strategy.start(grid=InProcessGrid(NUM_NODES, {}, client_app=tiny_app()),
                            initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=2, timeout=60,
                            evaluate_fn=evaluate_fn)
    assert set(result.evaluate_metrics_serverapp[2]) == {"norm", "norm-xbar"}


# ------------------------------------------------------------------------- FedAWE
def quadratic(tmp_path, **over):
    return {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 6,
            "num-server-rounds": 6, "local-steps": "steps:n=1", "batch-size": 1, "lr": 0.1,
            "availability": "bernoulli:p=0.5", "availability-gate": "client", "progress": False,
            "checkpoint-every": 0, "results-dir": str(tmp_path), "strategy": "fedawe:clip=0.5",
            "run-name": "serverapp", **over}


def test_fedawe_under_flowers_start_equals_the_project_serverapp(tmp_path, monkeypatch):
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
    over = quadratic(tmp_path)
    run_dir = run_inprocess(over, console=Console(quiet=True))
    expected = torch.load(run_dir / "final_model.pt", weights_only=True)

    run_config = {**default_run_config(), **over}
    setup = prepare(RunConfig.from_run_config(run_config))  # the strategy and model the ServerApp builds
    grid = InProcessGrid(6, run_config)
    result = Strategy.start(setup.strategy, grid=grid, initial_arrays=setup.arrays, num_rounds=6, timeout=60)
    got = result.arrays.to_torch_state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key].numpy(), expected[key].numpy(), rtol=1e-6, atol=1e-7)
    adopted = [m for m in grid.delivered if m.metadata.message_type == "train.adopt"]
    assert adopted  # the broadcast happened without the project's ServerApp


def test_fedawe_with_a_client_without_the_adopt_handler_fails_with_the_fix():
    strategy = build_strategy("fedawe", num_clients=NUM_NODES)
    with pytest.raises(StrategyFailure, match=r'app.train\("adopt"\)'):
        run_start(strategy, rounds=2, app=tiny_app(adopt_handler=False))


def test_fedawe_replies_from_a_plain_clientapp_fail_the_run_naming_the_helper():
    strategy = build_strategy("fedawe", num_clients=NUM_NODES, max_failed_rounds=1)
    with pytest.raises(StrategyFailure, match="client_rule_mod"):
        run_start(strategy, rounds=2, app=tiny_app(dropin=False, adopt_handler=False))


# ------------------------------------- integer arrays through issue 20's decode (the merge)
def test_integer_arrays_are_decoded_checked_and_kept_beside_the_vector():
    """The flat vector (and the reused reply buffer) holds only the floating arrays; each integer
    or boolean array is decoded like any other (:func:`decode`), then converted exactly, and a
    reply whose integer array cannot be the model's is rejected with the array's name."""
    from strategies.layout import Layout, Scratch, named_arrays
    from strategies.replies import ReplyRejected, model_delta

    model = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(7, np.int8),
             "mask": np.array([True, False]), "v": np.array([[0.5]], np.float32)}
    layout = Layout.of(named_arrays(model))
    assert layout.size == 3  # w and v only
    current = layout.flatten(named_arrays(model))
    out = Scratch().row(layout.size)

    reply = {**model, "w": np.array([2.0, 2.0], np.float32), "n": np.array(9.0), "mask": np.array([False, True])}
    delta, norm, integers = model_delta(named_arrays(reply), layout, current, out)
    assert delta is out and delta.tolist() == [1.0, 0.0, 0.0] and norm == 1.0
    assert integers["n"].dtype == np.int8 and int(integers["n"]) == 9 and integers["n"].shape == ()
    assert integers["mask"].tolist() == [False, True]

    for bad, why in [({"n": np.array(300)}, "outside int8's range"),
                     ({"n": np.array(np.nan)}, "NaN or Inf"),
                     ({"n": np.array("7")}, "dtype"),
                     ({"n": np.array(True)}, "dtype"),  # bools only where the model holds one
                     ({"w": np.array([True, False])}, "dtype"),
                     ({"n": np.array([7])}, "shape")]:
        with pytest.raises(ReplyRejected, match=why) as rejected:
            model_delta(named_arrays({**model, **bad}), layout, current, out)
        assert f"'{next(iter(bad))}'" in str(rejected.value)
