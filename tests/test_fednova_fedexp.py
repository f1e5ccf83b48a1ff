"""FedNova and FedExP: hand-computed rounds on mocked replies, closed forms on quadratics."""

import numpy as np
import pytest
from replies import reply, run_round, start_round

from experiments.inprocess import run_inprocess
from server_app.results import read_metrics
from strategies import FedAvgActive, build_strategy, named_arrays
from strategies.base import ClientReport
from strategies.rules.fedexp import FedExP
from strategies.rules.fednova import FedNova

# ---------------------------------------------------------------------------------- FedNova


def test_fednova_round_by_hand_with_data_size_weights():
    s = FedNova(num_clients=4, server_lr=0.5)
    assert s.weighting == "num-examples"  # the paper's p_i = n_i / n
    x = np.array([1.0, 0.0])
    sent = start_round(s, 1, x, [100, 101])
    replies = [reply(sent[100], x + [2.0, 0.0], **{"client-id": 0, "num-examples": 30, "a-norm": 2.0, "num-steps": 2}),
               reply(sent[101], x + [0.0, 8.0], **{"client-id": 1, "num-examples": 10, "a-norm": 4.0, "num-steps": 4})]
    arrays, metrics = s.aggregate_train(1, replies)
    tau_eff = 0.75 * 2 + 0.25 * 4
    u = tau_eff * (0.75 * np.array([2.0, 0]) / 2 + 0.25 * np.array([0, 8.0]) / 4)
    np.testing.assert_allclose(arrays["w"].numpy(), x + 0.5 * u, rtol=1e-6)
    assert metrics["tau-eff"] == pytest.approx(2.5)


def test_fednova_equal_weights_and_equal_steps_is_fedavg():
    updates = {0: np.array([1.0, 2.0]), 1: np.array([3.0, -2.0]), 2: np.array([0.5, 0.5])}
    nova = run_round(FedNova(num_clients=3, weighting="equal"), 1, np.zeros(2), updates, **{"a-norm": 7.0, "num-steps": 7})
    avg = run_round(FedAvgActive(num_clients=3), 1, np.zeros(2), updates)
    np.testing.assert_allclose(nova, avg, rtol=1e-6)


def test_fednova_rejects_replies_without_a_norm_and_says_why():
    s = FedNova(num_clients=3)
    sent = start_round(s, 1, np.zeros(1), [100, 101])
    good = reply(sent[100], [4.0], **{"client-id": 0, "a-norm": 2.0, "num-steps": 2})
    plain = reply(sent[101], [9.0], **{"client-id": 1, "num-steps": 2})  # a plain ClientApp: no a-norm
    arrays, metrics = s.aggregate_train(1, [good, plain])
    assert arrays["w"].numpy().tolist() == [4.0] and metrics["num-rejected"] == 1
    (node, reason), = s.round_log.rejected
    assert node == 101 and "a-norm" in reason and "FedNova needs" in reason
    with pytest.raises(ValueError, match="a-norm"):
        s.aggregate(0, np.zeros(1), [ClientReport(0, 100, np.ones(1, np.float32), 3)])


def test_fednova_server_momentum_by_hand_and_state():
    s = build_strategy("fednova:server-momentum=0.5", num_clients=2, min_available_nodes=1)
    assert s.rule.params.server_momentum == 0.5
    x = np.zeros(1)
    x1 = run_round(s, 1, x, {0: np.array([2.0])}, **{"a-norm": 1.0, "num-steps": 1})  # v = 2
    x2 = run_round(s, 2, x1, {0: np.array([4.0])}, **{"a-norm": 1.0, "num-steps": 1})  # v = 0.5·2 + 4 = 5
    np.testing.assert_allclose([x1[0], x2[0]], [2.0, 7.0])
    t = FedNova(num_clients=2, server_momentum=0.5, min_available_nodes=1)
    t.load_state_dict(s.state_dict())
    np.testing.assert_allclose(t.rule_state.buffer, [5.0])
    with pytest.raises(ValueError, match="server_momentum"):
        FedNova(server_momentum=1.0)


def quadratic_limit(strategy, e, tau, lr, rounds=3000):
    """Full participation, client i runs τ_i exact GD steps on ½‖x − e_i‖²: x_end − e_i = (1−η)^τ (x − e_i)."""
    x = np.zeros(e.shape[1])
    for t in range(rounds):
        reports = [ClientReport(client_id=i, node_id=100 + i, num_examples=1, a_norm=float(tau[i]),
                                delta=(1 - (1 - lr) ** tau[i]) * (e[i] - x)) for i in range(len(e))]
        x, _ = strategy.aggregate(t, x, reports)
    return x


def test_closed_form_fedavg_biased_by_local_steps_fednova_not():
    rng = np.random.default_rng(3)
    e = rng.normal(size=(4, 3)) * 2
    tau = np.array([1, 2, 5, 10])
    lr = 0.01
    w = 1 - (1 - lr) ** tau  # the exact weight of each client's pull
    x_star = e.mean(0)
    avg = quadratic_limit(FedAvgActive(num_clients=4), e, tau, lr)
    nova = quadratic_limit(FedNova(num_clients=4), e, tau, lr)
    np.testing.assert_allclose(avg, w @ e / w.sum(), atol=1e-9)  # FedAvg: Σ w_i e_i / Σ w_i
    v = w / tau  # FedNova pulls with w_i / τ_i = η + O(η² τ_i): exactly x* as η -> 0
    np.testing.assert_allclose(nova, v @ e / v.sum(), atol=1e-9)
    assert np.linalg.norm(nova - x_star) < 0.05 * np.linalg.norm(avg - x_star)
    assert np.linalg.norm(avg - tau @ e / tau.sum()) < 0.05 * np.linalg.norm(avg - x_star)


def distance_tail(tmp_path, strategy, **over):
    cfg = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 6,
           "num-server-rounds": 40, "availability": "always", "local-steps": "epochs:min=1,max=5",
           "batch-size": 1, "lr": 0.1, "progress": False, "checkpoint-every": 0, "eval-every": 1,
           "results-dir": str(tmp_path), "run-name": strategy.replace(":", "_"), "strategy": strategy, **over}
    rows = read_metrics(run_inprocess(cfg))
    assert all(r["num-participants"] == cfg["num-clients"] and r["num-rejected"] == 0 for r in rows)
    return float(np.mean([r["test-distance-to-optimum"] for r in rows[-10:]]))


def test_fednova_beats_fedavg_with_heterogeneous_epochs_end_to_end(tmp_path):
    """Real ClientApp, E_i ~ U{1..5} per client and round (n_i = 1, so τ_i = E_i)."""
    fedavg = distance_tail(tmp_path, "fedavg-active")
    fednova = distance_tail(tmp_path, "fednova")
    assert fednova < 0.5 * fedavg
    # local momentum: the client's ‖a_i‖_1 formula keeps FedNova unbiased as well
    mom = {"solver": "momentum", "momentum": 0.5, "lr": 0.05}
    assert distance_tail(tmp_path / "m", "fednova", **mom) < 0.5 * distance_tail(tmp_path / "m", "fedavg-active", **mom)


# ----------------------------------------------------------------------------------- FedExP


def test_fedexp_step_by_hand():
    s = FedExP(num_clients=3)
    x = np.array([1.0, 1.0])
    d = {0: np.array([2.0, 0.0]), 1: np.array([0.0, 2.0]), 2: np.array([-2.0, 0.0])}
    sent = start_round(s, 1, x, [100, 101, 102])
    arrays, metrics = s.aggregate_train(1, [reply(sent[100 + c], x + v, **{"client-id": c}) for c, v in d.items()])
    mean = np.array([0.0, 2 / 3])
    eta = 12 / (2 * 3 * (4 / 9 + 1e-3))  # Σ‖Δ_i‖² / (2M(‖Δ̄‖² + ε))
    assert metrics["fedexp-step"] == pytest.approx(eta)
    np.testing.assert_allclose(arrays["w"].numpy(), x + eta * mean, rtol=1e-6)


def test_fedexp_step_is_at_least_one():
    s = FedExP(num_clients=2)
    new, metrics = s.aggregate(0, np.zeros(2), [ClientReport(i, i, np.array([1.0, 1.0]), 1) for i in range(2)])
    assert metrics["fedexp-step"] == 1.0  # identical updates: ratio ½ -> clamped to 1
    np.testing.assert_allclose(new, [1.0, 1.0])


def test_fedexp_epsilon_options():
    s = build_strategy("fedexp:eps=0.01,eps-times-m=true,decay=0.5,max-step=0", num_clients=3)  # no cap
    assert s.rule.params.epsilon(0, 3) == pytest.approx(0.03) and s.rule.params.epsilon(2, 3) == pytest.approx(0.03 / 4)
    reps = [ClientReport(0, 0, np.array([1.0, 0.0]), 1), ClientReport(1, 1, np.array([-1.0, 0.2]), 1)]
    _, m = s.aggregate(2, np.zeros(2), reps)
    mean_sq = 0.1**2
    assert m["fedexp-step"] == pytest.approx((1 + 1.04) / (2 * 2 * (mean_sq + 0.01 * 0.25 * 2)))
    with pytest.raises(ValueError, match="decay"):
        FedExP(decay=0.0)


def test_fedexp_evaluates_the_average_of_the_last_two_iterates_and_trains_on_from_the_last():
    s = FedExP(num_clients=2)
    x0 = np.array([0.0, 0.0])
    x1 = run_round(s, 1, x0, {0: np.array([2.0, 0.0]), 1: np.array([0.0, 2.0])})  # η = 1: x1 = (1, 1)
    np.testing.assert_allclose(x1, [1.0, 1.0])
    shown = s.evaluation_arrays(named_arrays({"w": x1.astype(np.float32)}))
    np.testing.assert_allclose(shown["w"].numpy(), [0.5, 0.5])
    x2 = run_round(s, 2, x1, {0: np.array([2.0, 0.0]), 1: np.array([0.0, 2.0])})
    np.testing.assert_allclose(x2, [2.0, 2.0])  # training went on from x1, not from the average
    np.testing.assert_allclose(s.evaluation_arrays(named_arrays({"w": x2.astype(np.float32)}))["w"].numpy(),
                               [1.5, 1.5])
