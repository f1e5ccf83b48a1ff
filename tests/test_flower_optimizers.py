"""Flower's server optimizers (FedAdam, FedYogi, FedAdagrad, FedAvgM) as rules: their step is
Flower's, applied to the FedAvg average of the accepted replies, checked against hand-computed
Adam/Yogi/Adagrad/momentum updates (Reddi et al., ICLR 2021, Alg. 2; Hsu et al. 2019)."""

from __future__ import annotations

import numpy as np
import pytest
from replies import run_round

from strategies import build_strategy

UPDATES = [{0: np.array([0.2, -0.4, 0.1]), 1: np.array([0.0, -0.2, 0.3])},
           {0: np.array([-0.1, 0.1, 0.0]), 2: np.array([0.3, 0.1, 0.2])},
           {1: np.array([0.05, 0.0, -0.3])}]


def by_hand(kind: str, eta: float, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3, momentum: float = 0.0):
    """x over three rounds of equally weighted FedAvg averages fed to the optimizer."""
    x, m, v, buf = np.zeros(3), np.zeros(3), np.zeros(3), None
    out = []
    for t, ups in enumerate(UPDATES, start=1):
        d = np.mean(list(ups.values()), axis=0)
        if kind == "fedavgm":
            buf = d if buf is None or momentum == 0 else momentum * buf + d
            x = x + eta * buf
        else:
            m = b1 * m + (1 - b1) * d
            if kind == "fedadam":
                v = b2 * v + (1 - b2) * d**2
                x = x + eta * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) * m / (np.sqrt(v) + tau)
            elif kind == "fedyogi":
                v = v - (1 - b2) * d**2 * np.sign(v - d**2)
                x = x + eta * m / (np.sqrt(v) + tau)
            else:  # fedadagrad
                v = v + d**2
                x = x + eta * m / (np.sqrt(v) + tau)
        out.append(x.copy())
    return out


@pytest.mark.parametrize("spec, kind, kw", [
    ("fedadam:eta=0.05", "fedadam", {"eta": 0.05}),
    ("fedyogi:eta=0.02,beta-1=0.8", "fedyogi", {"eta": 0.02, "b1": 0.8}),
    ("fedadagrad:eta=0.1,tau=0.01", "fedadagrad", {"eta": 0.1, "tau": 0.01, "b1": 0.0}),  # Flower: no momentum
    ("fedavgm:server-momentum=0.9,server-learning-rate=0.5", "fedavgm", {"eta": 0.5, "momentum": 0.9}),
])
def test_the_server_step_is_flowers_optimizer_on_the_fedavg_average(spec, kind, kw):
    rule = build_strategy(spec, num_clients=3, weighting="equal")
    x = np.zeros(3, np.float32)
    for rnd, (ups, want) in enumerate(zip(UPDATES, by_hand(kind, **kw), strict=True), start=1):
        x = run_round(rule, rnd, x, ups)
        assert np.allclose(x, want, rtol=1e-4, atol=1e-6), (rnd, x, want)


def test_server_lr_is_refused_where_the_optimizer_has_its_own_step():
    with pytest.raises(ValueError, match="set 'fedadam:eta=...'"):
        build_strategy("fedadam", num_clients=3, server_lr=0.5)
    with pytest.raises(ValueError, match="server-learning-rate"):
        build_strategy("fedavgm", num_clients=3, server_lr=2.0)


def test_the_moments_are_the_rules_state_and_resume_bit_identically():
    a = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    x = run_round(a, 1, np.zeros(3, np.float32), UPDATES[0])
    saved = a.state_dict()
    b = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    b.load_state_dict(saved)
    assert np.array_equal(run_round(a, 2, x, UPDATES[1]), run_round(b, 2, x, UPDATES[1]))
    fresh = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    assert not np.array_equal(run_round(fresh, 2, x, UPDATES[1]), run_round(a, 3, x, UPDATES[1]))


def steepest_step(spec: str, sequence: list[np.ndarray]) -> float:
    """The largest |x^{t+1}_j − x^t_j| over a sequence of mean updates fed to the rule's step, in
    units of its proved ``step_bound`` (float32 rounding of x^t allowed for)."""
    rule = build_strategy(spec, num_clients=3).rule
    x, worst, bound, state = np.zeros(len(sequence[0]), np.float32), 0.0, rule.step_bound(), rule.State()
    for t, u in enumerate(sequence):
        done = rule.step(state, t, x, np.asarray(u, np.float32))
        new, state = done.model, done.state
        rounding = 2.0**-22 * np.maximum(np.abs(x), np.abs(new))
        worst = max(worst, float(np.max((np.abs(new.astype(np.float64) - x) - rounding) / bound)))
        x = new
    return worst


#: mean updates that push each optimiser's |m| / √v up: growing geometrically (Adam's
#: Cauchy-Schwarz extremal), halving, alternating in sign, a burst then almost nothing
HOSTILE = [np.array([1.1**t * 1e-6, 0.5**t, (-1) ** t, 1.0 if t < 5 else 1e-3, 1.0 if t % 50 == 0 else 1e-3])
           for t in range(200)]


@pytest.mark.parametrize("spec, reached", [("fedadam", 0.9), ("fedadam:bias-correction=false", 0.99),
                                           ("fedyogi", 0.2), ("fedadagrad", 0.99)])
def test_no_replies_move_a_coordinate_further_than_the_proved_step_bound(spec, reached):
    """docs/threat-model.md's adaptive-optimiser rows: every coordinate of the step is at most
    C η whatever the mean update (C: 2.35 FedAdam, 10.5 FedYogi, 1 FedAdagrad at their defaults),
    and the hostile sequence comes close to it (the bound is what an attacker can reach)."""
    worst = steepest_step(spec, HOSTILE)
    assert reached <= worst <= 1.0, (spec, worst)


def test_the_step_bound_is_the_formula_at_the_defaults_and_infinite_where_none_holds():
    assert build_strategy("fedadagrad", num_clients=3).rule.step_bound() == pytest.approx(0.1)
    assert build_strategy("fedyogi", num_clients=3).rule.step_bound() == pytest.approx(0.01 * 0.1 / 0.1 / (1 - 0.9 / 0.99**0.5))
    assert build_strategy("fedadam", num_clients=3).rule.step_bound() == pytest.approx(0.1 * 0.1 / 0.1 / (1 - 0.81 / 0.99) ** 0.5,
                                                                                  rel=1e-4)
    assert build_strategy("fedadam:beta-1=0.995,beta-2=0.99", num_clients=3).rule.step_bound() == np.inf  # β_1² ≥ β_2
    assert build_strategy("fedavgm", num_clients=3).rule.step_bound() == np.inf
