"""The shared strategy base and the FedAvg baselines, on mocked replies."""

import numpy as np
import pytest
from replies import error, reply, run_round, start_round

from strategies import STRATEGIES, FedAvgActive, FedAvgAll, FedAvgKnownP, Layout, build_strategy, named_arrays


def test_layout_round_trip_keeps_names_shapes_dtypes():
    big = 2**40 + 1  # float32 would round it
    rec = named_arrays({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([big], np.int64),
                        "s": np.array(1.5, np.float64), "n": np.array(3)})
    layout = Layout.of(rec)
    flat = layout.flatten(rec)  # the floating arrays only
    assert flat.dtype == np.float32 and flat.tolist() == [0, 1, 2, 3, 4, 5, 1.5] and layout.size == 7
    integers = layout.integers(rec)  # the others, exact
    assert integers["b"].tolist() == [big] and integers["n"].shape == ()
    back = layout.unflatten(flat * 2, integers)
    assert list(back.keys()) == ["a", "b", "s", "n"]
    assert back["b"].numpy().dtype == np.int64 and back["b"].numpy().tolist() == [big]
    assert back["a"].numpy().shape == (2, 3)
    assert back["s"].numpy().shape == () and back["s"].numpy().dtype == np.float64 and float(back["s"].numpy()) == 3.0
    assert back["n"].numpy().shape == () and int(back["n"].numpy()) == 3
    with pytest.raises(ValueError, match="'b'"):
        layout.unflatten(flat)


def test_fedavg_active_equal_and_data_size_weights():
    x = np.zeros(2)
    eq = run_round(FedAvgActive(num_clients=4), 1, x, {0: np.array([1.0, 0]), 2: np.array([3.0, 4])})
    np.testing.assert_allclose(eq, [2.0, 2.0])

    s = FedAvgActive(num_clients=4, weighting="num-examples", server_lr=0.5)
    sent = start_round(s, 1, x, [100, 102])
    replies = [reply(sent[100], [1.0, 0], **{"client-id": 0, "num-examples": 30}),
               reply(sent[102], [3.0, 4], **{"client-id": 2, "num-examples": 10})]
    arrays, metrics = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), 0.5 * np.array([0.75 * 1 + 0.25 * 3, 0.25 * 4]))
    assert metrics["num-participants"] == 2


def test_fedavg_all_divides_by_n_and_known_p_reweights():
    x = np.array([1.0, 1.0])
    new = run_round(FedAvgAll(num_clients=4), 1, x, {1: np.array([4.0, 0]), 3: np.array([0.0, 8])})
    np.testing.assert_allclose(new, x + np.array([1.0, 2.0]))

    p = np.array([0.5, 0.25, 1.0, 0.1])
    oracle = FedAvgKnownP(num_clients=4, probabilities=lambda t: p)
    new = run_round(oracle, 1, x, {1: np.array([4.0, 0]), 3: np.array([0.0, 8])})
    np.testing.assert_allclose(new, x + (np.array([4.0, 0]) / 0.25 + np.array([0.0, 8]) / 0.1) / 4, rtol=1e-6)


def test_known_p_reads_the_round_it_aggregates():
    seen = []
    oracle = FedAvgKnownP(num_clients=2, min_available_nodes=1, probabilities=lambda t: seen.append(t) or np.ones(2))
    run_round(oracle, 7, np.zeros(1), {0: np.ones(1)})
    assert seen == [6]  # 0-based round t = server round - 1


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_empty_round_keeps_the_model(name):
    spec = "pow-d:variant=rpow-d" if name == "pow-d" else name  # rpow-d: no probe round to fake
    s = build_strategy(spec, num_clients=3, min_available_nodes=1, probabilities=lambda t: np.ones(3))
    x = np.array([1.0, -2.0])
    sent = start_round(s, 1, x, [100, 101])
    arrays, metrics = s.aggregate_train(1, [error(sent[100])])
    np.testing.assert_array_equal(arrays["w"].numpy(), x)
    assert metrics["num-participants"] == 0 and metrics["num-unavailable"] == 2
    assert s.round_log.unavailable == [100, 101]


def test_errors_missing_replies_and_superlink_errors_count_as_unavailable():
    s = FedAvgActive(num_clients=5)
    sent = start_round(s, 1, np.zeros(1), [100, 101, 102, 103])
    replies = [reply(sent[100], [2.0], **{"client-id": 0}), error(sent[101]),
               error(sent[102], code=5, from_superlink=True)]
    arrays, _ = s.aggregate_train(1, replies)
    assert s.round_log.participants == [0]
    assert sorted(s.round_log.unavailable) == [101, 102, 103]  # 102 traced via reply_to
    assert arrays["w"].numpy().tolist() == [2.0]


@pytest.mark.parametrize(
    ("model", "metrics", "why"),
    [
        ([np.nan], {}, "NaN"),
        ([np.inf], {}, "NaN or Inf"),
        ([1.0, 2.0], {}, "shape"),
        ([1.0], {"num-examples": 0}, "num-examples"),
        ([1.0], {"num-examples": 10**12}, "num-examples"),
        ([1.0], {"num-steps": -3}, "num-steps"),
        ([1.0], {"a-norm": 0.0}, "a-norm"),
        ([1.0], {"train-loss": float("nan")}, "train-loss"),
        ([1.0], {"client-id": 99}, "client-id"),
    ],
)
def test_bad_replies_are_rejected_with_reason_and_do_not_move_the_model(model, metrics, why):
    s = FedAvgActive(num_clients=5)
    sent = start_round(s, 1, np.zeros(1), [100, 101])
    good = reply(sent[100], [4.0], **{"client-id": 0})
    bad = reply(sent[101], model, **{"client-id": 1, **metrics})
    arrays, out = s.aggregate_train(1, [good, bad])
    assert arrays["w"].numpy().tolist() == [4.0]
    assert out["num-rejected"] == 1
    (node, reason), = s.round_log.rejected
    assert node == 101 and why in reason


def test_missing_records_wrong_keys_duplicates_and_strangers_are_rejected():
    from flwr.app import Message, MetricRecord, RecordDict

    s = FedAvgActive(num_clients=5)
    sent = start_round(s, 1, np.zeros(1), [100, 101, 102])
    no_arrays = Message(RecordDict({"metrics": MetricRecord({"num-examples": 3})}), reply_to=sent[100])
    no_count = Message(RecordDict({"arrays": named_arrays({"w": np.ones(1, np.float32)}),
                                   "metrics": MetricRecord({"x": 1})}), reply_to=sent[101])
    wrong_key = Message(RecordDict({"arrays": named_arrays({"v": np.ones(1, np.float32)}),
                                    "metrics": MetricRecord({"num-examples": 3})}), reply_to=sent[102])
    s.aggregate_train(1, [no_arrays, no_count, wrong_key])
    reasons = dict(s.round_log.rejected)
    assert "ArrayRecord" in reasons[100] and "num-examples" in reasons[101] and "keys" in reasons[102]

    sent = start_round(s, 2, np.zeros(1), [100, 101])
    twice = [reply(sent[100], [1.0], **{"client-id": 3}), reply(sent[101], [5.0], **{"client-id": 3})]
    arrays, _ = s.aggregate_train(2, twice)
    assert arrays["w"].numpy().tolist() == [1.0] and "second reply" in s.round_log.rejected[0][1]


def test_client_id_falls_back_to_node_id_for_plain_clientapps():
    s = FedAvgActive()
    sent = start_round(s, 1, np.zeros(1), [100, 101])
    s.aggregate_train(1, [reply(sent[100], [1.0]), reply(sent[101], [3.0])])
    assert s.round_log.participants == [100, 101]


def test_state_dict_round_trip_restores_the_generator():
    a = FedAvgActive(num_clients=3, seed=5)
    a.rng.random(3)
    state = a.state_dict()
    expected = a.rng.random(4)
    b = FedAvgActive(num_clients=3, seed=999)
    b.load_state_dict(state)
    np.testing.assert_array_equal(b.rng.random(4), expected)


def test_registry_errors_name_the_choices():
    with pytest.raises(ValueError, match="known"):
        build_strategy("fedavgg")
    with pytest.raises(ValueError, match="oracle"):
        build_strategy("fedavg-known-p", num_clients=3)
    with pytest.raises(ValueError, match="weighting"):
        FedAvgActive(weighting="size")


@pytest.mark.parametrize("name", sorted(n for n, c in STRATEGIES.items() if c.needs_client_ids))
def test_rules_with_per_client_state_key_replies_without_a_client_id_by_node(name):
    s = build_strategy(name, num_clients=1, probabilities=lambda t: np.ones(1))
    sent = start_round(s, 1, np.zeros(1), [100])
    s.aggregate_train(1, [reply(sent[100], [1.0])])  # no client-id: the node gets a row of its own
    assert s.round_log.participants == [0] and s.node_of_client == {0: 100}
    sent = start_round(s, 2, np.zeros(1), [100, 101])
    s.aggregate_train(2, [reply(sent[100], [1.0]), reply(sent[101], [1.0])])
    assert s.round_log.participants == [0]  # the same row again; no row left for a new node
    assert [node for node, _ in s.round_log.rejected] == [101] and "client-id" in s.round_log.rejected[0][1]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_auto_weighting_resolves_to_the_papers_weighting(name):
    cls = STRATEGIES[name]
    paper = ("num-examples" if name in ("fednova", "fedavg-active", "fedadam", "fedyogi", "fedadagrad", "fedavgm")
             else "equal")  # p_i = n_i / n (Flower's optimizers: its FedAvg weighting)
    assert cls.paper_weighting == paper
    for given in ({"weighting": "auto"}, {}):  # "auto" is the default
        s = build_strategy(name, num_clients=3, probabilities=lambda t: np.ones(3), **given)
        assert s.weighting == paper
    if not cls.equal_weights_only:
        assert build_strategy(name, num_clients=3, probabilities=lambda t: np.ones(3),
                              weighting="equal").weighting == "equal"


def test_no_extra_scored_models_by_default():
    assert FedAvgActive(num_clients=2).extra_evaluation_arrays(named_arrays({"w": np.ones(1)})) == {}
