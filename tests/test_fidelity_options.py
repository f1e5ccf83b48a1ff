"""The options where a rule's paper and its official code (or Flower's class) part, each against
values computed by hand or by an independent reference: FedAsync's staleness numbering (Xie et
al.'s t − τ >= 1), FedPBC's first-commit step, FedAdam without Flower's bias correction (Reddi et
al. Alg. 2), FedStale's q_i / p_i weights (the paper's and the code's ActivityEstimator)."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import reference_rules as ref
from replies import reply, run_round
from test_new_rules import LR, X0, E, H, K, N, ours, participation

from strategies import build_strategy, named_arrays


# ------------------------------------------------------------------ FedAsync
def one_fresh_arrival(spec: str, x0: np.ndarray, d: np.ndarray) -> np.ndarray:
    s = build_strategy(spec, num_clients=2)
    s.begin(named_arrays({"w": x0}))
    msg, version = s.job(100, 1)
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    out = s.arrive(reply(msg, x0 + d, **{"client-id": 0}), msg, version, {100, 101})
    assert out.staleness == 0 and out.aggregated  # recorded as 0 either way
    return s.current


def test_fedasync_staleness_offset_follows_xie_et_al_numbering():
    x0, d = np.array([1.0, -2.0], np.float32), np.array([0.4, 0.2], np.float32)
    base = "fedasync:alpha=0.5,staleness=poly,staleness-a=0.5"
    # code numbering: a fresh update has s(0) = 1, α_t = 0.5
    np.testing.assert_allclose(one_fresh_arrival(base, x0, d), x0 + 0.5 * d, rtol=1e-6)
    # Xie et al. Alg. 1: the freshest update has t − τ = 1, α_t = 0.5 · 2^(−1/2) = 0.35355
    np.testing.assert_allclose(one_fresh_arrival(base + ",staleness-offset=1", x0, d), x0 + 0.35355339 * d,
                               rtol=1e-6)
    with pytest.raises(ValueError, match="staleness-offset=2"):
        build_strategy("fedasync:staleness-offset=2", num_clients=2)


# ------------------------------------------------------------------ FedPBC
def test_fedpbc_first_commit_step_is_the_codes_first_published_update():
    """``w_tmp += (w_tmp - w_local) * lr_global`` at lr_global = 1: x_i + 2 (x_i^end − x_i); the
    reference is the paper's update with η_g = 2, written independently."""
    P = participation(2)
    got = ours("fedpbc:code-step=first-commit", P)
    want = ref.fedpbc(H, E, P, X0, K, LR, server_lr=2.0)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    fixed = ref.fedpbc(H, E, P, X0, K, LR)
    assert np.abs(fixed - want).max() > 1e-2  # the two steps differ on this run
    with pytest.raises(ValueError, match="code-step=first-commit and catch-up=true"):
        build_strategy("fedpbc:code-step=first-commit,catch-up=true", num_clients=N)


# ------------------------------------------------------------------ FedAdam
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fedadam_first_step_by_hand(bias_correction):
    """Round 1 from m = v = 0 with Δ̄ = u: m = 0.1 u, v = 0.01 u²; Reddi et al. Alg. 2 steps
    η m / (√v + τ); Flower's class multiplies η by √(1 − 0.99²) / (1 − 0.9²) (its round 1, exponent 2)."""
    x0, u = np.array([0.5, -1.0, 2.0], np.float32), np.array([0.2, -0.05, 0.0], np.float32)
    s = build_strategy(f"fedadam:eta=0.1,tau=0.001,bias-correction={str(bias_correction).lower()}",
                       num_clients=1, weighting="equal")
    got = run_round(s, 1, x0, {0: u})
    step = 0.1 * (0.1 * u.astype(np.float64)) / (np.sqrt(0.01 * u.astype(np.float64) ** 2) + 0.001)
    if bias_correction:
        step *= math.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 2)
    np.testing.assert_allclose(got, x0 + step, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ FedStale
def activity_estimator(P: np.ndarray) -> np.ndarray:
    """The official code's ActivityEstimator (cutoff 1e8), rounds × clients of 1/p̂ (its
    weights_matrix, transposed): round t reads the intervals closed by participations before t."""
    rounds, n = P.shape
    w = np.ones((rounds, n))
    for i in range(n):
        intervals, current = 0, 0
        for t in range(1, rounds):
            current += 1
            if P[t - 1, i] == 1:
                w[t, i] = current if intervals == 0 else (intervals * w[t - 1, i] + current) / (intervals + 1)
                intervals, current = intervals + 1, 0
            else:
                w[t, i] = w[t - 1, i]
    return w


def fedstale_paper(P: np.ndarray, beta: float) -> np.ndarray:
    """v = Σ_{i∈A_t} (q_i / p̂_i)(Δ_i − β y_i) + β Σ_j q_j y_j, q = 1/N (Rodio & Neglia Alg. 1;
    the code's UnbiasedClientsSampler and HistoryTracker.average)."""
    omega = activity_estimator(P)
    x, y = np.array(X0, np.float64), np.zeros((N, len(X0)))
    for t in range(P.shape[0]):
        active = np.flatnonzero(P[t])
        if not len(active):
            continue
        deltas = {i: ref.local_sgd(H, E, i, x, K, LR)[0] - x for i in active}
        v = sum(omega[t, i] / N * (deltas[i] - beta * y[i]) for i in active) + beta * y.mean(axis=0)
        x = x + v
        for i in active:
            y[i] = deltas[i]
    return x


@pytest.mark.parametrize("beta", [0.3, 1.0])
def test_fedstale_paper_weights_against_the_official_estimator(beta):
    P = participation(3)
    got = ours(f"fedstale:beta={beta},weights=paper", P)
    want = fedstale_paper(P, beta)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (got, want)
    default = ref.fedstale(H, E, P, X0, K, LR, beta)  # 1/|A_t|: another model under uneven participation
    assert np.abs(default - want).max() > 1e-3
    with pytest.raises(ValueError, match="weights='equal'"):
        build_strategy("fedstale:weights=equal", num_clients=N)
