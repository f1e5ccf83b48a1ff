"""Update sanity bounds in the shared base: no reply can crash a rule or poison its state.

Every registered rule gets a round with one finite but huge update (the tester's 1e20 and 3e38);
it must be rejected with its reason, leave the model and the rule's state exactly as a round
without that reply would, and raise nothing. Then the bounds' edges: honest spreads pass, the
ratio needs 3 replies, spec keys work; and FedAWARE's solver on extreme but finite momenta.
"""

import dataclasses
import logging

import numpy as np
import pytest
from replies import rule_reply, start_round

from strategies import STRATEGIES, FedAvgActive, build_strategy
from strategies.bounds import MAX_NORM_RATIO, MAX_UPDATE_NORM
from strategies.rules.fedaware import FedAWARE, direction

DIM, N = 3, 4


def make(name, **kwargs):
    spec = "pow-d:variant=rpow-d" if name == "pow-d" else name  # rpow-d: no probe round to fake
    if "scaffold" in name:  # one sketch for both strategies compared (the default is a fresh secret one)
        spec += ":sketch-seed=7"
    return build_strategy(spec, num_clients=N, probabilities=lambda t: np.full(N, 0.5), seed=3, **kwargs)


def honest(name, sent, model, client, update):
    """A reply every rule accepts (:func:`replies.rule_reply`: FedNova's a-norm and num-steps;
    FedAWE's and FedPBC's echo factor 1 and u_i = Δ_i; SCAFFOLD's Δc_i)."""
    return rule_reply(name, sent, model, client, np.asarray(update, np.float32))


def play(strategy, name, rnd, x, updates, silent=()):
    """Clients c (node 100 + c) reply x + updates[c]; nodes of ``silent`` clients are addressed too."""
    nodes = sorted({100 + c for c in (*updates, *silent)})
    sent = start_round(strategy, rnd, x, nodes)
    replies = [honest(name, sent[100 + c], np.asarray(x, np.float32) + u, c, u) for c, u in updates.items()]
    arrays, metrics = strategy.aggregate_train(rnd, replies)
    return arrays["w"].numpy(), metrics


def same(a, b, path="state"):
    """Recursive equality of two state_dicts (arrays exactly, NaN = NaN)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if k not in ("run_key", "sketch_seed", "sketches"):  # FedAWE: a random name and a secret projection per run
                same(a[k], b[k], f"{path}.{k}")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):  # FedBuff's pending arrivals
        assert type(a) is type(b), path
        same({f.name: getattr(a, f.name) for f in dataclasses.fields(a)},
             {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}, path)
    elif isinstance(a, (list, tuple)) or (isinstance(a, np.ndarray) and a.dtype == object):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}.{i}")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=path)
    else:
        assert a == b or (a != a and b != b), path


ROUND1 = {0: np.array([0.5, -0.25, 1.0]), 1: np.array([-0.5, 0.75, 0.25]), 2: np.array([0.25, 0.5, -1.0])}
ROUND2 = {c: 0.5 * u[::-1] for c, u in ROUND1.items()} | {3: np.array([0.1, 0.2, 0.3])}


@pytest.mark.parametrize("value", [1e20, 3e38])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_huge_update_is_rejected_and_leaves_model_and_state_as_without_it(name, value):
    attacked, clean = make(name), make(name)
    x = np.array([1.0, -1.0, 2.0])
    bad = dict(ROUND1) | {3: np.full(DIM, value) - x}  # client 3 replies a model of entries `value`
    got, metrics = play(attacked, name, 1, x, bad)
    want, _ = play(clean, name, 1, x, ROUND1, silent=[3])
    np.testing.assert_array_equal(got, want)
    assert np.all(np.isfinite(got)) and metrics["num-rejected"] == 1
    (node, reason), = attacked.round_log.rejected
    # the absolute cap, or for FedAWE and FedPBC their consistency check, which runs on the reply alone first
    assert node == 103 and (("max-update-norm 1e+06" in reason and "update norm" in reason)
                            or "consistency check" in reason), reason
    assert attacked.round_log.participants == [0, 1, 2]
    same(attacked.state_dict(), clean.state_dict())  # stored tables, momenta, bindings untouched
    table = getattr(getattr(attacked, "rule_state", None), "table", None)
    if name in ("mifa", "fedvarp", "stale", "fedstale", "cluster-fedvarp"):  # the stored-updates rules
        rows = 3 if name != "cluster-fedvarp" else int(attacked.rule_state.cluster_of[3])
        assert table is not None and not table.seen[rows] and not table.row(rows).any()
    # the next round, with client 3 honest, continues identically: nothing of the bad update is replayed
    got2, _ = play(attacked, name, 2, got, ROUND2)
    want2, _ = play(clean, name, 2, want, ROUND2)
    np.testing.assert_array_equal(got2, want2)
    assert np.all(np.abs(got2) < 100)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_default_bounds_accept_an_honest_spread_of_norms(name):
    # the measured honest extremes (benchmarks/honest_variation.py): 7.3 x the round's median, 12.3 x
    # the running reference (FedAWE's ‖u_i‖/(t − τ_i)); every other rule's ‖Δ_i‖ within 2.4 x
    norms = [0.05, 0.8, 1.5, 2.0, 9.0 if s_default_ratio(name) < 30 else 27.0]
    n = len(norms)
    s = build_strategy("pow-d:variant=rpow-d" if name == "pow-d" else name, num_clients=n,
                       probabilities=lambda t: np.full(n, 0.5))
    updates = {c: np.array([norm, 0.0, 0.0]) for c, norm in enumerate(norms)}
    _, metrics = play(s, name, 1, np.zeros(DIM), updates)
    assert s.round_log.rejected == [] and s.round_log.participants == list(range(n))
    assert max(norms) / np.median(norms) > 5  # the spread is wide: it would fail a ratio of 5


def test_ratio_needs_three_replies_and_a_nonzero_median():
    """Round 1: every reply is a newcomer's, so beyond the ratio bound it is cut (with the reason
    a rejection would have), not rejected; the absolute cap still rejects."""
    def beyond(norms, **bounds):
        s = FedAvgActive(num_clients=len(norms), **bounds)
        play(s, "fedavg-active", 1, np.zeros(DIM), {c: np.array([v, 0.0, 0.0]) for c, v in enumerate(norms)})
        return s.round_log.rejected + s.round_log.cut

    (node, reason), = beyond([1.0, 2.0, 1.5, 300.0], max_norm_ratio=100)
    assert node == 103 and "max-norm-ratio 100 x the median of recent norms 1.5" in reason  # the lower median
    assert "a newcomer: cut to the bound" in reason
    assert beyond([1.0, 300.0], max_norm_ratio=100) == []  # a median of two says nothing
    (node, reason), = beyond([0.0, 0.0, 5.0], max_norm_ratio=100)  # a zero reference still bounds
    assert node == 102 and "median of recent norms 0" in reason
    assert beyond([1.0, 2.0, 1.5, 300.0], max_norm_ratio=0) == []  # 0 = off
    # the median is taken over the replies under the absolute cap: two huge ones do not raise it
    reasons = [why for _, why in beyond([1.0, 2.0, 1.5, 300.0, 1e7, 1e8], max_norm_ratio=100)]
    assert sum("max-update-norm" in r for r in reasons) == 2 and sum("max-norm-ratio" in r for r in reasons) == 1
    assert beyond([1e7], max_update_norm=0) == []  # no cap


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_bounds_are_spec_keys_of_every_rule(name):
    base = "pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:"
    s = build_strategy(base + "max-norm-ratio=50,max-update-norm=1e3", num_clients=N,
                       probabilities=lambda t: np.ones(N))
    assert (s.max_norm_ratio, s.max_update_norm) == (50.0, 1000.0)
    assert make(name).max_update_norm == MAX_UPDATE_NORM
    assert make(name).max_norm_ratio == s_default_ratio(name) and s_default_ratio(name) in (MAX_NORM_RATIO, 30.0)


def s_default_ratio(name):
    return STRATEGIES[name].default_norm_ratio


@pytest.mark.parametrize(("bounds", "why"), [
    ({"max_norm_ratio": 1.0}, "max-norm-ratio"), ({"max_norm_ratio": -2.0}, "max-norm-ratio"),
    ({"max_update_norm": -1.0}, "max-update-norm"), ({"max_update_norm": float("inf")}, "max-update-norm"),
])
def test_bad_bounds_are_refused_naming_the_key(bounds, why):
    with pytest.raises(ValueError, match=why):
        FedAvgActive(num_clients=3, **bounds)


# ------------------------------------------------------------------------------ FedAWARE's solver
def aware_direction(rows):
    """FedAWARE's direction on momenta ``rows``, every client seen."""
    return direction(np.asarray(rows, np.float32), np.ones(len(rows), bool))


def test_fedaware_direction_is_finite_and_right_for_extreme_finite_momenta():
    rng = np.random.default_rng(0)
    v = rng.normal(size=50)
    v /= np.linalg.norm(v)
    # a vector of norm 1e30 and its opposite of norm 1e-30: the min-norm point of ±v is 0
    d, info = aware_direction([1e30 * v, -1e-30 * v])
    assert np.all(np.isfinite(d)) and np.linalg.norm(d) < 1e-6 and info["solver-fallback"] == 0
    # near-duplicates at 1e30 (and one 3e38 entry): the min-norm point is v itself
    rows = [1e30 * v, 1e30 * (v + 1e-7 * rng.normal(size=50)), 1e30 * v * (1 + 1e-7)]
    d, info = aware_direction(rows)
    assert np.all(np.isfinite(d)) and abs(np.linalg.norm(d) - 1) < 1e-4 and abs(d @ v - 1) < 1e-4
    assert info["solver-fallback"] == 0
    # a momentum of norm 1e-25 (its float32 squared norm underflows to 0) still counts: v ⟂ w -> (v + w)/2
    w = rng.normal(size=50)
    w -= (w @ v) * v
    w /= np.linalg.norm(w)
    d, _ = aware_direction([v, 1e-25 * w])
    np.testing.assert_allclose(d, (v + w) / 2, atol=1e-5)
    d, _ = aware_direction([np.full(50, 3e38), -np.full(50, 3e38) + 1e31])
    assert np.all(np.isfinite(d)) and np.linalg.norm(d) <= 1 + 1e-6


def test_fedaware_with_bounds_off_survives_huge_replies():
    s = FedAWARE(num_clients=3, min_seen=1, max_update_norm=0, max_norm_ratio=0)
    ups = {0: np.full(DIM, 1e30), 1: np.full(DIM, 1e30) * (1 + 1e-6), 2: np.array([-3e38, 0.0, 3e38])}
    new, metrics = play(s, "fedaware", 1, np.zeros(DIM), ups)
    assert np.all(np.isfinite(new)) and metrics["num-participants"] == 3
    assert np.all(np.isfinite(s.rule_state.momenta))


def test_fedaware_solver_failure_falls_back_to_equal_weights_and_is_logged(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr("strategies.rules.fedaware.min_norm_solve", broken)
    with caplog.at_level(logging.ERROR):
        d, info = aware_direction([[2.0, 0.0], [0.0, 4.0]])
    np.testing.assert_allclose(d, [0.5, 0.5])  # the mean of the unit momenta
    assert info["solver-fallback"] == 1 and "SVD did not converge" in caplog.text
