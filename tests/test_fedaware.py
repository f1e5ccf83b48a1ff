"""FedAWARE: the min-norm solver against a QP / brute force, and the rule on mocked replies."""

import numpy as np
import pytest
from replies import run_round
from scipy.optimize import minimize

from strategies import build_strategy
from strategies.base import ClientReport
from strategies.rules.fedaware import FedAWARE, direction, min_norm_solve, min_norm_weights


def objective(gram, lam):
    return float(lam @ gram @ lam)


def qp_minimum(gram):
    """min over the simplex of λᵀMλ by SLSQP from a few starts (the reference)."""
    n = len(gram)
    cons = [{"type": "eq", "fun": lambda v: v.sum() - 1, "jac": lambda v: np.ones(n)}]
    best = np.inf
    for seed in range(3):
        start = np.random.default_rng(seed).dirichlet(np.ones(n))
        res = minimize(lambda v: v @ gram @ v, start, jac=lambda v: 2 * gram @ v, method="SLSQP",
                       bounds=[(0, 1)] * n, constraints=cons, options={"ftol": 1e-15, "maxiter": 1000})
        best = min(best, res.fun)
    return best


def unit_rows(v):
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def check_feasible(lam, n):
    assert lam.shape == (n,) and lam.min() >= 0 and lam.sum() == pytest.approx(1, abs=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_solver_matches_the_qp_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(3, 13)), int(rng.choice([2, 3, 5, 20, 100]))
    v = unit_rows(rng.normal(size=(n, d)))
    if seed % 4 == 0:
        v[1] = v[0]  # a duplicate
    if seed % 5 == 0:
        v[2] = -v[0]  # an opposite pair: the minimum is 0
    gram = v @ v.T
    lam = min_norm_weights(gram)
    check_feasible(lam, n)
    assert objective(gram, lam) <= qp_minimum(gram) + 1e-6
    assert objective(gram, lam) >= -1e-12


def test_plain_frank_wolfe_alone_can_stop_short_and_the_exact_finish_fixes_it():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(30):
        n, d = int(rng.integers(3, 13)), int(rng.choice([3, 5]))
        gram = (v := unit_rows(rng.normal(size=(n, d)))) @ v.T
        plain, _ = min_norm_solve(gram, polish=False)
        exact = min_norm_weights(gram)
        check_feasible(plain, n)
        assert objective(gram, exact) <= objective(gram, plain) + 1e-15
        worst = max(worst, objective(gram, plain) - objective(gram, exact))
    assert worst > 1e-6  # why the finish exists (measured: up to ~1e-3 after 1000 FW iterations)


def test_three_vectors_against_an_exhaustive_grid():
    rng = np.random.default_rng(7)
    step = 1e-3
    a = np.arange(0, 1 + step / 2, step)
    l1, l2 = np.meshgrid(a, a, indexing="ij")
    ok = l1 + l2 <= 1 + 1e-12
    grid = np.stack([l1[ok], l2[ok], np.clip(1 - l1[ok] - l2[ok], 0, None)], axis=1)
    for _ in range(5):
        v = unit_rows(rng.normal(size=(3, 4)))
        gram = v @ v.T
        brute = np.einsum("ki,ij,kj->k", grid, gram, grid).min()
        value = objective(gram, min_norm_weights(gram))
        assert value <= brute + 1e-12  # at least as good as every grid point
        assert value >= brute - 1e-2 * step  # and the grid comes close to it
        assert value == pytest.approx(qp_minimum(gram), abs=1e-6)


def test_opposite_vectors_give_half_half_and_zero():
    v = np.array([[1.0, 2.0, 0.5], [-1.0, -2.0, -0.5]])
    lam, _ = min_norm_solve(v @ v.T)
    np.testing.assert_allclose(lam, [0.5, 0.5], atol=1e-12)
    assert objective(v @ v.T, lam) == pytest.approx(0, abs=1e-12)


def test_duplicates_single_vector_and_closed_form_pair():
    e1, e2 = np.eye(2)
    v = np.stack([e1, e1, e2])
    lam = min_norm_weights(v @ v.T)
    assert lam[0] + lam[1] == pytest.approx(0.5) and lam[2] == pytest.approx(0.5)
    assert min_norm_weights(np.array([[4.0]])).tolist() == [1.0]
    # two vectors a, b with a·b >= a·a: the minimum is a itself
    v = np.array([[1.0, 0.0], [2.0, 0.5]])
    np.testing.assert_allclose(min_norm_weights(v @ v.T), [1.0, 0.0])
    # general pair: γ = (b·b − a·b)/‖a − b‖²
    v = np.array([[1.0, 0.0], [-0.5, 1.0]])
    gamma = (1.25 + 0.5) / (1.5**2 + 1.0)
    np.testing.assert_allclose(min_norm_weights(v @ v.T), [gamma, 1 - gamma], atol=1e-12)
    with pytest.raises(ValueError, match="square"):
        min_norm_weights(np.zeros((2, 3)))


def test_fedaware_step_by_hand():
    """Three clients, all seen in round 1: m_i = ½ g_i, m̂ = e1, e2, (e1+e2)/√2 -> d = (½, ½)."""
    s = FedAWARE(num_clients=3, server_lr=0.5)
    x = np.array([1.0, 1.0])
    new = run_round(s, 1, x, {0: np.array([-2.0, 0.0]), 1: np.array([0.0, -4.0]), 2: np.array([-2.0, -2.0])})
    np.testing.assert_allclose(new, x - 0.5 * np.array([0.5, 0.5]), atol=1e-6)
    np.testing.assert_allclose(s.rule_state.momenta, [[1, 0], [0, 2], [1, 1]])
    assert s.rule_state.momenta.dtype == np.float32 and s.rule_state.momenta.shape == (3, 2)


def test_fedavg_until_all_seen_then_momenta_of_absent_clients_are_kept():
    s = FedAWARE(num_clients=3, alpha=0.5)
    x = np.zeros(2)
    x1 = run_round(s, 1, x, {0: np.array([-2.0, 0.0]), 1: np.array([0.0, -4.0])})
    np.testing.assert_allclose(x1, [-1.0, -2.0])  # FedAvg over active: client 2 never seen yet
    np.testing.assert_allclose(s.rule_state.momenta, [[1, 0], [0, 2], [0, 0]])
    # round 2: only client 2; now all seen. m_2 = ½ (2, 2)·... -> m̂_2 = (1, 1)/√2
    x2 = run_round(s, 2, x1, {2: np.array([-2.0, -2.0])})
    np.testing.assert_allclose(x2, x1 - np.array([0.5, 0.5]), atol=1e-6)
    # round 3: client 0 again: m_0 = ½ m_0 + ½ g_0
    run_round(s, 3, x2, {0: np.array([2.0, 0.0])})
    np.testing.assert_allclose(s.rule_state.momenta[0], [0.5 * 1 + 0.5 * -2, 0])


def test_min_seen_excludes_never_seen_and_zero_momenta():
    s = FedAWARE(num_clients=4, min_seen=2, server_lr=1.0)
    x = np.zeros(2)
    new = run_round(s, 1, x, {0: np.array([-2.0, 0.0]), 1: np.array([0.0, -2.0]), 3: np.zeros(2)})
    # client 3 sent Δ = 0 (m = 0), client 2 never seen: both left out -> min norm of e1, e2
    np.testing.assert_allclose(new, [-0.5, -0.5], atol=1e-6)
    d, info = direction(s.rule_state.momenta, s.rule_state.seen)
    assert info["lambda-support"] == 2


def test_empty_round_state_and_registry():
    s = build_strategy("fedaware:alpha=0.25,min-seen=1", num_clients=3)
    assert isinstance(s, FedAWARE) and s.rule.params.alpha == 0.25 and s.rule.params.min_seen == 1
    x = np.ones(3, np.float32)
    rep = [ClientReport(client_id=1, node_id=101, delta=np.array([1, 0, 0], np.float32), num_examples=5)]
    new, metrics = s.aggregate(0, x, rep)
    np.testing.assert_allclose(new, x - np.array([-1.0, 0, 0]), atol=1e-6)  # d = m̂_1 = −e1
    same, _ = s.aggregate(1, new, [])
    np.testing.assert_array_equal(same, new)
    t = FedAWARE(num_clients=3)
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.rule_state.momenta, s.rule_state.momenta)
    assert t.rule_state.seen.tolist() == [False, True, False]
    unknown = FedAWARE()  # N not given: the base takes the nodes connected at the first round
    with pytest.raises(ValueError, match="num_clients"):
        unknown.aggregate(0, x, rep)  # called without that round: a clear error, not a wrong N
    with pytest.raises(ValueError, match="min_seen"):
        FedAWARE(num_clients=3, min_seen=4)
